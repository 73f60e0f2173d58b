"""Chaos with real processes: two shards, two training workers, and the faults a job must outlive.

- shard 1 SIGKILLed mid-training and restarted on its port, and every connection to shard 0
  reset once: both workers finish with exactly the parameters of an uninterrupted run (the
  reference replay of every step), so no step was lost or applied twice; over gRPC and over the
  raw data plane;
- a shard that does not come back within CGX_PS_RECOVERY_TIMEOUT fails every worker, naming it;
- a SIGSTOPped shard (connections stay up) fails every worker within its round timeout + 10 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from cgx_ps.v1 import ps_pb2, ps_pb2_grpc
from support import METADATA, SECURITY, plane_env, plane_settings, until
from test_worker import env_for, expected_params
from workers.warm_start import start_worker

ROOT = Path(__file__).resolve().parents[1]
STEP_WORKER = ROOT / "tests/workers/step_worker.py"



class CuttableProxy:
    """A TCP proxy in front of one shard whose connections the test resets at will (a transient
    network fault: the shard stays up, the workers see their streams reset)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> int:
        """Reset every connection now (RST, as a dropped NAT entry or a restarted router would)."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            # Wake the pump thread blocked in recv() on it first: on Linux, close() alone while
            # another thread is in recv() neither wakes it nor resets the connection until data
            # arrives, so a cut could leave a connection silently stalled (the test then hung,
            # 1 run in ~20 under load). SHUT_RD sends nothing; the close then sends the RST.
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RD)
            s.close()
        return len(sockets)

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.cut()


def rounds_completed(address: str) -> int:
    with SECURITY.sync_channel(address) as channel:
        return ps_pb2_grpc.ParameterServerStub(channel).Status(ps_pb2.StatusRequest(), timeout=5,
                                                               metadata=METADATA).rounds_completed


def wait_for_rounds(address: str, rounds: int, workers: list[subprocess.Popen], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if rounds_completed(address) >= rounds:
                return
        except grpc.RpcError:
            pass
        dead = [p.returncode for p in workers if p.poll() is not None]
        assert not dead, f"a worker exited (codes {dead}) before shard {address} completed {rounds} rounds"
        assert time.monotonic() < deadline, f"shard {address} did not complete {rounds} rounds"
        time.sleep(0.05)


def start_workers(servers: list[str], tmp_path: Path, steps: int, **env: str) -> list[subprocess.Popen]:
    job = {"CGX_PS_JOB_ID": f"chaos-{uuid.uuid4().hex[:8]}", **env}
    # a small model in many blocks (both shards own several), so the reference replay is quick
    return [start_worker([sys.executable, str(STEP_WORKER), "--steps", str(steps), "--step-sleep", "0.05",
                          "--hidden", "100", "--block-bytes", "8192", "--out", str(tmp_path / f"rank{r}.pt")],
                         env=env_for(r, 2, servers, **job), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
            for r in range(2)]


def established(port: int) -> int:
    """Established TCP connections whose local end is ``port`` on this host (the shard's side)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        count += int(local.rsplit(":", 1)[1], 16) == port and state == "01"
    return count


def finish_with_shard_stopped(cluster, shard: int, workers: list[subprocess.Popen],
                              timeout_s: float) -> tuple[list[tuple[int, str, float]], float]:
    """``finish`` while shard ``shard`` is SIGSTOPped (alive to TCP and keepalive, answering
    nothing), and when it was stopped (time.monotonic()); it is continued after."""
    os.kill(cluster.procs[shard].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        return finish(workers, timeout_s), stopped
    finally:
        os.kill(cluster.procs[shard].pid, signal.SIGCONT)


def finish(workers: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str, float]]:
    """(exit code, stderr, time.monotonic() at which it printed ShardUnavailableError, else inf) of
    each worker; kills any still running after ``timeout_s``. (The moment the error is raised, not
    the process exit, which interpreter teardown delays on a loaded machine.)"""
    raised = [float("inf")] * len(workers)
    errs: list[list[str]] = [[] for _ in workers]

    def read(i: int) -> None:
        for line in workers[i].stderr:
            if "ShardUnavailableError" in line and raised[i] == float("inf"):
                raised[i] = time.monotonic()
            errs[i].append(line)

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(workers))]
    for t in readers:
        t.start()
    for p in workers:
        try:
            p.wait(timeout=max(0.1, timeout_s))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for t in readers:
        t.join(timeout=10)
    return [(p.returncode, "".join(errs[i]), raised[i]) for i, p in enumerate(workers)]


@pytest.mark.slow
def test_shard_restart_and_reset_connections_are_survived_exactly(tmp_path: Path, plane: str, local_cluster) -> None:
    """On the raw data plane the streams do not pass the proxy (a worker dials the data port its
    shard advertises): its cut resets their gRPC channels to shard 0 alone, and the SIGKILL breaks
    their streams to shard 1, whose restarted instance opens another data port that the rejoin
    must find."""
    steps = 24
    cluster = local_cluster(2, round_timeout=30, **plane_settings(plane))
    proxy = CuttableProxy(cluster.ports[0])
    try:
        workers = start_workers([f"127.0.0.1:{proxy.port}", cluster.addresses[1]], tmp_path, steps,
                                CGX_PS_RECOVERY_TIMEOUT="30", **plane_env(plane))
        wait_for_rounds(cluster.addresses[0], 6, workers)
        if plane == "raw":  # a stream per worker and shard, on the plane
            assert [established(port) for port in cluster.data_ports] == [2, 2]
        assert proxy.cut() >= 4  # both workers' connections to shard 0, both directions
        wait_for_rounds(cluster.addresses[1], 12, workers)
        cluster.procs[1].kill()  # SIGKILL: no drain, rounds in flight are lost with it
        cluster.procs[1].wait()
        time.sleep(1.0)
        cluster.restart(1)  # same port, new instance: a new session must be resumed
        if plane == "raw":  # each worker's rejoin finds the new data port (in its own time)
            wait_for_rounds(cluster.addresses[1], 3, workers)
            deadline = time.monotonic() + 30
            while established(cluster.data_ports[1]) < 2 and time.monotonic() < deadline:
                assert all(p.poll() is None for p in workers), "a worker exited before its rejoin"
                time.sleep(0.05)
            assert established(cluster.data_ports[1]) == 2
        results = finish(workers, timeout_s=120)
    except AssertionError:
        for p in workers:  # say why a worker stopped
            p.kill()
            print(p.stderr.read()[-3000:], file=sys.stderr)
        raise
    finally:
        proxy.close()
    everything = "\n".join(f"rank {r} (exit {code}):\n{err[-3000:]}" for r, (code, err, _) in enumerate(results))
    for code, err, _ in results:
        assert code == 0, everything
        assert "rejoined the restarted shard" in err, err[-3000:]
        assert plane == "raw" or "reopened the stream" in err, err[-3000:]  # the cut streams, on gRPC
    saved = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    expected = expected_params(saved[0], 2, steps, 1, torch.float32)
    for name, value in expected.items():
        assert torch.equal(saved[0]["final"][name], saved[1]["final"][name]), name  # replicas bit-identical
        assert torch.equal(saved[0]["final"][name], value), name  # every step applied exactly once


@pytest.mark.slow
def test_a_shard_not_back_within_the_recovery_timeout_fails_every_worker(tmp_path: Path, local_cluster) -> None:
    cluster = local_cluster(2, round_timeout=30)
    workers = start_workers(cluster.addresses, tmp_path, 10_000, CGX_PS_RECOVERY_TIMEOUT="3")
    wait_for_rounds(cluster.addresses[1], 3, workers)
    cluster.procs[1].kill()
    killed = time.monotonic()
    results = finish(workers, timeout_s=30)
    cluster.restart(1)  # back after the workers gave up: too late, they must not have waited for it
    for r, (code, err, exited) in enumerate(results):
        assert code != 0 and "ShardUnavailableError" in err, f"rank {r}:\n{err[-3000:]}"
        assert f"shard {cluster.addresses[1]} did not come back within the recovery timeout of 3s" in err, err[-3000:]
        assert exited - killed < 3 + 10, f"rank {r} raised {exited - killed:.1f}s after the kill"


@pytest.mark.slow
def test_a_stopped_shard_fails_every_worker_within_its_round_timeout_and_10s(tmp_path: Path, local_cluster) -> None:
    round_timeout = 3
    cluster = local_cluster(2, round_timeout=round_timeout)
    workers = start_workers(cluster.addresses, tmp_path, 10_000)  # recovery timeout: the default 60 s
    wait_for_rounds(cluster.addresses[1], 3, workers)
    results, stopped = finish_with_shard_stopped(cluster, 1, workers, timeout_s=30)
    for r, (code, err, exited) in enumerate(results):
        assert code != 0 and "ShardUnavailableError" in err, f"rank {r}:\n{err[-3000:]}"
        assert f"shard {cluster.addresses[1]} sent no result" in err, err[-3000:]
        assert exited - stopped < round_timeout + 10, f"rank {r} raised {exited - stopped:.1f}s after the stop"


@pytest.mark.slow
def test_a_stopped_shard_is_named_by_every_local_rank_of_a_node(tmp_path: Path, local_cluster) -> None:
    """With 2 local ranks, the rank that does not own a block of the
    stopped shard timed out first on its owner ("result from its owner (local rank 0 stalled?)")
    and torchrun killed the owner before it named the shard. Now the owner posts the shard's error
    to its node and the other rank waits past the owner's shard timeout: both name the shard."""
    round_timeout = 3
    job = f"chaos-{uuid.uuid4().hex[:8]}"
    cluster = local_cluster(2, round_timeout=round_timeout)
    workers = [start_worker([sys.executable, str(STEP_WORKER), "--steps", "10000", "--step-sleep", "0.05",
                             "--hidden", "100", "--block-bytes", "8192", "--out", str(tmp_path / f"r{r}.pt")],
                            env=env_for(r, 2, cluster.addresses, CGX_PS_JOB_ID=job, LOCAL_RANK=str(r),
                                        LOCAL_WORLD_SIZE="2", CGX_PS_NODE_RANK="0", CGX_PS_NUM_NODES="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for r in range(2)]
    wait_for_rounds(cluster.addresses[1], 3, workers)
    results, stopped = finish_with_shard_stopped(cluster, 1, workers, timeout_s=60)
    for r, (code, err, exited) in enumerate(results):
        assert code != 0 and "ShardUnavailableError" in err, f"local rank {r}:\n{err[-3000:]}"
        assert f"shard {cluster.addresses[1]} sent no result" in err, err[-3000:]
        assert "stalled?" not in err, err[-3000:]
        assert exited - stopped < round_timeout + 20, f"local rank {r} raised {exited - stopped:.1f}s after the stop"
    # (which rank raises the node's first error and which relays it, "(reported by local rank N)",
    # depends on which of the shard's blocks each owns and when its own pushes went unanswered)


# ---- a connection that breaks while a push is being written, in-process --------------------------

SHARD_SETTINGS = dict(round_timeout_s=30.0)  # the conftest `start_shard` fixture's


async def test_a_connection_broken_under_a_push_is_recovered_not_taken_for_a_refusal(start_shard, caplog) -> None:
    """Issue 15's 1-in-12 flake: when the connection breaks while a push is being written,
    grpc.aio ends the stream with INTERNAL "Internal error from Core" (the failed write replaces
    the transport's UNAVAILABLE), which the worker took for the shard's refusal and failed. Here
    every reset lands while a large push is being written, so most ends carry that status: each
    must be recovered (the stream reopened, the push sent again) and the round's result arrive."""
    from cgx_ps.kernels import Codec, dequantize, encode
    from cgx_ps.worker.shards.client import ShardClient
    from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

    shard = await start_shard()
    proxy = CuttableProxy(shard.port)
    layout = build_layout([TensorInfo("w", (2048, 1024))], 1, Compression(bits=None), block_bytes=8 << 20)
    client = ShardClient(f"127.0.0.1:{proxy.port}", "node-0", 1, layout, connect_timeout_s=10, security=SECURITY,
                         job_id=f"cut-{uuid.uuid4().hex[:6]}", recovery_timeout_s=20)
    caplog.set_level("WARNING", logger="cgx_ps.worker.shards.client")
    cuts = 8
    try:
        await client.connect()
        for round_ in range(cuts):
            values = torch.full((2048 * 1024,), float(round_ + 1))
            payload = encode(values, Codec.FP32).to_bytes()  # 8 MiB: 8 chunks, written for a while
            exchange = asyncio.create_task(client.exchange(0, round_, payload))
            await asyncio.sleep(0.002 * (round_ % 4))  # somewhere in the middle of its chunks
            assert await asyncio.to_thread(proxy.cut) >= 2  # a live connection, both directions
            result = await asyncio.wait_for(exchange, 30)
            assert torch.equal(dequantize(result), values), f"round {round_}"  # one node: the sum is its push
            # A cut can land just after its round's result arrived (a fast shard): the repair then
            # runs in the background, and the next cut, made meanwhile, would break the repair's
            # own attempt or find no connection, so two cuts would count one recovery (5 of 8 with
            # every other cut after its result and a repair 0.3 s slower, as on a loaded machine).
            # The next round starts on the repaired connection.
            await until(lambda cut=round_ + 1: client.recoveries >= cut or client.error is not None, 30,
                        f"the repair after cut {round_ + 1}")
        values = torch.full((2048 * 1024,), float(cuts + 1))  # the last repaired connection carries a round
        result = await asyncio.wait_for(client.exchange(0, cuts, encode(values, Codec.FP32).to_bytes()), 30)
        assert torch.equal(dequantize(result), values)
        assert client.error is None and client.recoveries == cuts
    finally:
        await client.close()
        proxy.close()
    causes = [r.getMessage() for r in caplog.records if "connection lost" in r.getMessage()]
    print("\n".join(causes))
    assert any("broke while pushing" in c for c in causes), causes  # the race this test is about was hit


# ---- a job restarted with a replaced node: launchers' counts differ per node --------------------

@pytest.mark.parametrize("replaced_first", [True, False])
async def test_a_replaced_node_counting_from_zero_joins_its_restarted_job(start_shard, replaced_first: bool,
                                                                          plane: str) -> None:
    """torchrun counts restarts per agent and a replaced pod's counts from 0: after a restart
    node-0 says 3 and the new node-1 says 0. Both must join one new session, in either order,
    and get the same incarnation from the shard; a process of the earlier start may not rejoin.
    On both planes: the stream of the ended session is refused over the raw data plane too."""
    from cgx_ps.kernels import Codec, dequantize, encode
    from cgx_ps.worker.shards.client import ShardClient
    from cgx_ps.worker.errors import CgxPsError
    from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

    shard = await start_shard(data_port=0 if plane == "raw" else -1)
    layout = build_layout([TensorInfo("w", (64, 64))], 1, Compression(bits=None))
    job = f"replaced-{uuid.uuid4().hex[:6]}"

    def client(node: str, count: int) -> ShardClient:
        return ShardClient(f"127.0.0.1:{shard.port}", node, 2, layout, connect_timeout_s=10, security=SECURITY,
                           job_id=job, incarnation=count, recovery_timeout_s=5, dataplane=plane)

    async def train_round(clients: list[ShardClient], round_: int) -> None:
        values = [torch.full((4096,), float(i + 1)) for i in range(len(clients))]
        results = await asyncio.gather(*[c.exchange(0, round_, encode(v, Codec.FP32).to_bytes())
                                         for c, v in zip(clients, values)])
        for result in results:
            assert torch.equal(dequantize(result), sum(values))

    first = [client("node-0", 2), client("node-1", 2)]
    for c in first:
        await c.connect()
    await train_round(first, 0)
    assert [c.registration.incarnation for c in first] == [2, 2]
    streams = shard.metrics.registry.get_sample_value("cgx_ps_exchange_streams", {"shard": "0", "plane": plane})
    assert streams == 2  # both nodes' streams on the plane under test
    await first[1].close()  # node-1's pod is gone; node-0's old process lingers (a stale one)

    restarted = [client("node-0", 3), client("node-1", 0)]  # the replaced pod counts from 0
    try:
        for c in (reversed(restarted) if replaced_first else restarted):
            await c.connect()
        await train_round(restarted, 0)  # a new session: round 0 again
        assert [c.registration.incarnation for c in restarted] == [3, 3]  # the shard's count, above 2
        with pytest.raises(CgxPsError):  # the old start's stream was ended with its session
            await asyncio.wait_for(first[0].exchange(0, 1, encode(torch.ones(4096), Codec.FP32).to_bytes()), 10)
        stale = ps_pb2.RegisterRequest(node_id="node-0", num_nodes=2, layout=layout, job_id=job, resume=True,
                                       layout_hash=first[0].layout_hash, incarnation=2)
        with pytest.raises(grpc.aio.AioRpcError, match="left over from an earlier start"):  # nor rejoin
            await ps_pb2_grpc.ParameterServerStub(first[0].channel).Register(stale, timeout=5, metadata=METADATA)
        await train_round(restarted, 1)  # undisturbed
    finally:
        for c in [first[0], *restarted]:
            await c.close()


# ---- one shard gone for good: the exchanges on the others end with its error, in-process ----------

async def test_a_shard_gone_for_good_ends_the_exchanges_waiting_on_the_other_shards_with_its_error(
        start_shard) -> None:
    """The CI flake of the last session (a worker still running 30 s after its shard's recovery
    timeout): when one shard does not come back, the other nodes stop, so a round of another
    shard that waits for their pushes would end only at that shard's round timeout. A front end
    waiting for such a block first (blocks are waited for in order) reported nothing until then.
    Here node-1 never pushes the block of shard 0: that exchange must end with shard 1's
    ShardUnavailableError right after the recovery timeout, not at shard 0's round timeout."""
    from cgx_ps.kernels import Codec, encode
    from cgx_ps.worker.shards.client import ShardClient
    from cgx_ps.worker.config import WorkerConfig
    from cgx_ps.worker.shards.engine import CommEngine
    from cgx_ps.worker.errors import ShardUnavailableError
    from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

    shards = [await start_shard(shard_index=i, num_shards=2, round_timeout_s=120.0) for i in range(2)]
    servers = tuple(f"127.0.0.1:{s.port}" for s in shards)
    layout = build_layout([TensorInfo("a", (64, 64)), TensorInfo("b", (64, 64))], 2, Compression(bits=None),
                          block_bytes=64 * 64 * 4)
    block_of = {b.shard: b.block_id for b in layout.blocks}
    assert set(block_of) == {0, 1}, layout  # one block on each shard
    config = WorkerConfig(rank=0, world_size=2, node_rank=0, num_nodes=2, servers=servers, security=SECURITY,
                          job_id=f"gone-{uuid.uuid4().hex[:6]}", recovery_timeout_s=1.0, connect_timeout_s=10)
    engine = CommEngine(config, "node-0", 2)
    others = [ShardClient(a, "node-1", 2, layout, connect_timeout_s=10, security=SECURITY, job_id=config.job_id)
              for a in servers]
    try:
        await asyncio.gather(asyncio.to_thread(engine.connect, layout), *[c.connect() for c in others])
        payload = encode(torch.ones(64 * 64), Codec.FP32).to_bytes()
        waiting = [asyncio.wrap_future(engine.submit(engine.push_pull(shard, block_of[shard], 0, payload)))
                   for shard in (0, 1)]
        await until(lambda: all(c.bytes_sent for c in engine.clients), 10, "node-0's pushes")
        await shards[1].stop(drain=False)  # and not back: node-1 stops too, and never pushes to shard 0
        gone = time.monotonic()
        for shard in (0, 1):
            with pytest.raises(ShardUnavailableError, match=f"shard {servers[1]} did not come back"):
                await asyncio.wait_for(waiting[shard], 30)
        assert time.monotonic() - gone < 1.0 + 15, "ended long after the recovery timeout"
    finally:
        for c in others:
            await c.close()
        await asyncio.to_thread(engine.close)


# ---- control calls across a shard restart, in-process --------------------------------------------

async def test_the_link_probe_and_codec_settings_are_made_again_after_a_shard_restart(start_shard) -> None:
    """Auto mode's link probe and SetCodecs go through recovery too: made while the shard is
    down, they wait for the rejoin and are made once more, on the new instance."""
    from cgx_ps.worker.shards.client import ShardClient
    from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

    shard = await start_shard()
    port = shard.port
    layout = build_layout([TensorInfo("w", (64, 64))], 1, Compression(bits=4, bucket_size=512))
    client = ShardClient(f"127.0.0.1:{port}", "node-0", 1, layout, connect_timeout_s=10, security=SECURITY,
                         job_id=f"probe-{uuid.uuid4().hex[:6]}", recovery_timeout_s=20)
    try:
        await client.connect()
        first_instance = client.registration.instance_id
        await shard.stop(drain=False)

        async def restart_later() -> None:
            await asyncio.sleep(0.5)
            await start_shard(port=port)

        restarting = asyncio.create_task(restart_later())
        seconds = await asyncio.wait_for(client.probe(1 << 20), 30)  # made while the shard is down
        await restarting
        assert seconds > 0 and client.registration.instance_id != first_instance  # on the new instance
        codec = ps_pb2.CodecSettings(codec=ps_pb2.CODEC_MAXMIN, bits=2, bucket_size=512)
        await client.set_codecs(1, [ps_pb2.BlockCodec(block_id=0, codec=codec)])  # in the rejoined session
        assert client.error is None and client.recoveries == 1
    finally:
        await client.close()


async def test_a_control_call_failing_after_the_connection_was_replaced_does_not_break_the_new_one(
        start_shard) -> None:
    """The race behind a flaky CI run: a probe made as the shard went away failed UNAVAILABLE
    only after the supervisor had already reconnected, and marked the *new* stream broken, so
    the client recovered twice. Such a failure must retry on the new connection, not break it."""
    from cgx_ps.worker.shards.client import ShardClient
    from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

    shard = await start_shard()
    layout = build_layout([TensorInfo("w", (64, 64))], 1, Compression(bits=4, bucket_size=512))
    client = ShardClient(f"127.0.0.1:{shard.port}", "node-0", 1, layout, connect_timeout_s=10, security=SECURITY,
                         job_id=f"race-{uuid.uuid4().hex[:6]}", recovery_timeout_s=20)
    attempts: list[int] = []

    async def fails_once_after_a_replacement() -> float:
        attempts.append(client.stream.generation)
        if len(attempts) == 1:
            await client.reopen()  # what a supervisor's drop-and-reopen did meanwhile
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "Socket closed")
        return 1.5

    try:
        await client.connect()
        assert await asyncio.wait_for(client._control("Probe", fails_once_after_a_replacement), 10) == 1.5
        assert attempts[1] == attempts[0] + 2  # the retry ran on the replacement, at once
        await asyncio.sleep(0.3)  # a wrongly set break would have started a recovery by now
        assert await client.stream.wait_broken(0.01) is None and client.recoveries == 0 and client.error is None
    finally:
        await client.close()


# ---- the shard's side of a resumed session, in-process ---------------------------------------------

class _Sink:
    def __init__(self) -> None:
        self.delivered: list[tuple[int, int, bytes, dict]] = []

    def deliver(self, block_id, round_, result, pushers) -> None:
        assert (result.block_id, result.round) == (block_id, round_)  # frames of this result
        self.delivered.append((block_id, round_, bytes(result), dict(pushers)))

    def round_failed(self, failure) -> None:
        raise AssertionError(failure)


def _aggregator(resumed: bool):
    from cgx_ps.kernels import Codec, encode
    from cgx_ps.server.rounds.aggregator import Aggregator
    from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

    layout = build_layout([TensorInfo("w", (64, 64))], 1, Compression(bits=4, bucket_size=512))
    sink = _Sink()
    agg = Aggregator(list(layout.blocks), 2, None, sink, {"n0", "n1"}, round_timeout_s=30, resumed=resumed)
    payload = encode(torch.randn(4096), Codec.MAXMIN, bits=2, bucket_size=512).to_bytes()  # not the layout's bits
    return agg, sink, payload


@pytest.mark.parametrize("restore_first", [True, False])
async def test_a_resumed_block_gives_a_restored_result_to_the_nodes_still_waiting(restore_first: bool) -> None:
    """Node n0 saw round 5 finish before the restart, n1 did not: n1 must get n0's bytes, and
    round 6 is summed normally, in the encoding the pushes bring."""
    from cgx_ps.server.errors import BadRequest

    agg, sink, payload = _aggregator(resumed=True)
    result5 = payload  # any well-formed block of the right size stands for round 5's result
    if restore_first:
        assert (await agg.restore("n0", 0, 0, 5, result5)).accepted
        outcome = await agg.push("n1", 0, 0, 5, payload)  # n1's kept push of round 5
        assert bytes(outcome.resend) == result5 and outcome.resend.round == 5 and not sink.delivered
    else:
        assert (await agg.push("n1", 0, 0, 5, payload)).accepted  # round 5 starts here...
        assert (await agg.restore("n0", 0, 0, 5, result5)).accepted  # ...but finished before the restart
        assert sink.delivered == [(0, 5, result5, {"n1": 0})]
    assert not (await agg.restore("n1", 0, 0, 4, payload)).accepted  # an older result: ignored
    sink.delivered.clear()
    for node in ("n0", "n1"):
        assert (await agg.push(node, 0, 0, 6, payload)).accepted
    assert [(b, r, pushers) for b, r, _, pushers in sink.delivered] == [(0, 6, {"n0": 0, "n1": 0})]
    with pytest.raises(Exception, match="cannot restore round 7"):  # summed here since: too late
        await agg.restore("n0", 0, 0, 7, result5)
    plain, _, _ = _aggregator(resumed=False)
    with pytest.raises(BadRequest, match="only into a session resumed"):
        await plain.restore("n0", 0, 0, 0, result5)


def test_a_stream_that_ended_under_our_write_is_recovered_and_a_shard_error_is_final() -> None:
    """The decision behind the test above, pure: grpc's local marker of a failed write means the
    connection broke (recover, and retry a reconnect); a shard's own INTERNAL is final."""
    from cgx_ps.worker.shards.recovery import WRITE_FAILED_DETAILS, Fail, Recover, after_stream_end, connect_failure

    assert isinstance(after_stream_end("INTERNAL", WRITE_FAILED_DETAILS, False), Recover)
    assert connect_failure("s:1", "INTERNAL", WRITE_FAILED_DETAILS) is None
    shard_error = "shard error in Exchange: KeyError"
    assert after_stream_end("INTERNAL", shard_error, False) == Fail("INTERNAL", shard_error)
    assert connect_failure("s:1", "INTERNAL", shard_error) is not None
    # a failed TLS handshake is final; a name lookup of a host called mtls-... is not a handshake
    handshake = "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.7:7070: Ssl handshake " \
                "failed: SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED"
    assert connect_failure("s:1", "UNAVAILABLE", handshake, tls=True) is not None
    lookup = "DNS resolution failed for mtls-shard-0.cgx-ps:7070: C-ares status is not ARES_SUCCESS"
    assert connect_failure("s:1", "UNAVAILABLE", lookup, tls=True) is None
