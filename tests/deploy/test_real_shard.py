"""The real shard, started the way the StatefulSet starts it (on loopback): health, metrics and
a clean exit within the grace period, in plaintext and with mutual TLS; and a worker configured
as the Job configures it, streaming over the shard's plane (gRPC, or the raw data plane with
optional/data-plane)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from cgx_ps.cli import wait_for_shards as wfs
from cgx_ps.net.security import ChannelSecurity
from cgx_ps.server.cluster import STARTUP_TIMEOUT_S, launch_shard, wait_for_port_file
from cgx_ps.cli.status_table import probe
from cgx_ps.worker.shards.client import ShardClient
from cgx_ps.worker.config import WorkerConfig
from rounds import check_aggregate, close, encode_block, make_layout

from .kubelet import container_env, expanded_args, materialize
from .manifests import DOWNWARD, REPO, SHARD_INDEX_FIELD, TOKEN_KEY, container, pod_spec, shard_sts, worker_job


@contextlib.contextmanager
def real_shard(tmp_path: Path, rel: str, files: dict[str, bytes]):
    """The shard of ``rel`` started with its manifest's command and environment, on loopback
    and free ports (this runs on a shared machine), with its Secret files from ``files``.
    Yields (process, bound ports, environment, StatefulSet)."""
    try:
        import cgx_ps.server.main  # noqa: F401
    except Exception as exc:  # the server is developed alongside; its own tests cover it
        pytest.skip(f"cgx_ps.server does not import: {exc!r}")
    sts = shard_sts(rel)
    c = container(sts, "shard")
    env = materialize(container_env(rel, c, {SHARD_INDEX_FIELD: "0"}), tmp_path / "pod", files)
    args = expanded_args(c, env)
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = "0"
    args[args.index("--metrics-port") + 1] = "0"
    if "--data-port" in args and int(args[args.index("--data-port") + 1]) >= 0:
        args[args.index("--data-port") + 1] = "0"
    if "CGX_PS_HEALTH_PORT" in env:
        env["CGX_PS_HEALTH_PORT"] = "0"
    port_file = tmp_path / "ports.json"
    proc_env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_PS_")}
    proc_env.update(env)
    # a cache of its own, as the manifest gives the pod, shared by these tests: one cold compile
    proc_env["NUMBA_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / "cgx-ps-test-numba-cache")
    assert args[0] == "server", args
    proc = launch_shard(args[1:], port_file, env=proc_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        try:
            # its own NUMBA_CACHE_DIR, as the manifest sets: the shard compiles its kernels cold
            info = wait_for_port_file(proc, port_file, time.monotonic() + STARTUP_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as exc:
            proc.kill()  # reading a live shard's output would wait for it forever
            raise AssertionError(f"shard {exc}: {proc.communicate()[0]}") from None
        yield proc, info, env, sts
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop_within_grace(proc, env, sts):
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    grace = pod_spec(sts)["terminationGracePeriodSeconds"]
    assert proc.wait(timeout=grace) == 0
    assert time.monotonic() - t0 < float(env["CGX_PS_DRAIN_TIMEOUT"]) + 5


TEST_TOKEN = b"0123456789abcdef0123456789abcdef\n"   # as `openssl rand -hex 16 > token` writes it


def test_real_shard_with_the_manifest_environment(tmp_path):
    """Health SERVING, the metrics the docs describe, and a clean exit 0 on SIGTERM well
    within terminationGracePeriodSeconds."""
    with real_shard(tmp_path, "overlays/cpu-local", {TOKEN_KEY: TEST_TOKEN}) as (proc, ports, env, sts):
        assert wfs.wait([f"127.0.0.1:{ports['port']}"], timeout=20, interval=0.2, log=lambda s: None)
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics_port']}/metrics", timeout=10) as r:
            text = r.read().decode()
        docs = (REPO / "docs" / "deploy.md").read_text()
        for metric in ("cgx_ps_bytes_in_total", "cgx_ps_rounds_total", "cgx_ps_round_latency_seconds",
                       "cgx_ps_last_node_wait_seconds", "cgx_ps_compression_ratio",
                       "cgx_ps_connected_nodes", "cgx_ps_exchange_streams"):
            assert metric in text, f"{metric} not exported"
            assert metric in docs, f"{metric} not described in docs/deploy.md"
        stop_within_grace(proc, env, sts)


def test_real_shard_with_the_tls_manifest_environment(tmp_path, pki):
    """cpu-local-tls: the kubelet's view (plaintext gRPC health on the health port) and the
    workers' (mutual TLS on the gRPC port, with the init container's environment)."""
    files = {TOKEN_KEY: TEST_TOKEN, **pki["shard"]}
    rel = "overlays/cpu-local-tls"
    with real_shard(tmp_path, rel, files) as (proc, ports, env, sts):
        assert ports.get("health_port", -1) > 0, f"no health port bound: {ports}"
        quiet = dict(interval=0.2, rpc_timeout=1, log=lambda s: None)
        assert wfs.wait([f"127.0.0.1:{ports['health_port']}"], timeout=20, **quiet)   # the probes
        init = container(worker_job(rel), "wait-for-shards", init=True)
        worker_env = materialize(container_env(rel, init, DOWNWARD), tmp_path / "worker", pki["worker"])
        grpc_address = f"127.0.0.1:{ports['port']}"
        assert wfs.wait([grpc_address], timeout=20, security=ChannelSecurity.from_env(worker_env), **quiet)
        assert not wfs.wait([grpc_address], timeout=1, **quiet)   # no plaintext on the gRPC port
        no_client_cert = ChannelSecurity(tls_ca=worker_env["CGX_PS_TLS_CA"],
                                             server_name=worker_env["CGX_PS_TLS_SERVER_NAME"])
        assert not wfs.wait([grpc_address], timeout=1, security=no_client_cert, **quiet)
        stop_within_grace(proc, env, sts)


def _streams_by_plane(metrics_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.labels["plane"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "cgx_ps_exchange_streams" for s in f.samples}


@pytest.mark.parametrize("rel, plane", [("overlays/cpu-local", "grpc"), ("overlays/cpu-local-data-plane", "raw")])
async def test_workers_as_the_job_configures_them_stream_over_the_shards_plane(tmp_path, rel: str, plane: str):
    """A shard with its rendered arguments (its data port, if any, made free for this shared
    machine) and its Job's workers, with their environment: they keep CGX_PS_DATAPLANE's default,
    auto, and take the plane the shard offers (gRPC by default, the raw data plane with
    optional/data-plane); their round's sums are exact; the shard's metrics count their streams
    on that plane and `cgx-ps status` shows its data port (0: none)."""
    with real_shard(tmp_path, rel, {TOKEN_KEY: TEST_TOKEN}) as (proc, ports, env, sts):
        assert (ports["data_port"] > 0) is (plane == "raw"), f"the rendered shard's ports: {ports}"
        worker = container(worker_job(rel), "worker")
        worker_env = materialize(container_env(rel, worker, DOWNWARD), tmp_path / "worker", {TOKEN_KEY: TEST_TOKEN})
        dataplane = WorkerConfig.from_env(worker_env).dataplane
        assert dataplane == "auto"
        security = ChannelSecurity.from_env(worker_env)
        # the Job's layout: sharded over every shard; this one (index 0) serves its own blocks
        layout = make_layout(shards=int(env["CGX_PS_NUM_SHARDS"]))
        owned = [b for b in layout.blocks if b.shard == 0]
        assert owned
        address, nodes = f"127.0.0.1:{ports['port']}", int(env["CGX_PS_NUM_NODES"])
        workers = [ShardClient(address, f"node-{i}", nodes, layout, connect_timeout_s=20, security=security,
                               dataplane=dataplane) for i in range(nodes)]
        try:
            for w in workers:
                await w.connect()
            pushed = {b.block_id: [encode_block(b, torch.randn(b.numel), seed=i) for i in range(nodes)] for b in owned}
            results = await asyncio.wait_for(asyncio.gather(*[w.exchange(b.block_id, 0, pushed[b.block_id][i])
                                                              for i, w in enumerate(workers) for b in owned]), 60)
            for k, result in enumerate(results):
                block = owned[k % len(owned)]
                check_aggregate(block, pushed[block.block_id], result)
            assert _streams_by_plane(ports["metrics_port"]) == {"grpc": 0, "raw": 0, plane: nodes}
        finally:
            await close(workers)
        report = probe(0, address, security, int(env["CGX_PS_NUM_SHARDS"]))
        assert report.ok, report.problems
        assert report.status.data_port == max(ports["data_port"], 0)
        stop_within_grace(proc, env, sts)
