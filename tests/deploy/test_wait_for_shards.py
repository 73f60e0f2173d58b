"""`cgx-ps wait-for-shards` (the workers' init container): shard addresses, waiting for
SERVING, timing out naming the missing shard, the command as the init container runs it, and
mutual TLS like the workers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from cgx_ps.cli import wait_for_shards as wfs
from cgx_ps.net.addresses import servers_from_env
from cgx_ps.net.security import ChannelSecurity

from .certificates import grpc_name_matches
from .kubelet import container_env, init_args, materialize
from .manifests import DOWNWARD, container, worker_job


def wait_main(env: dict[str, str], *argv: str) -> int:
    from cgx_ps import cli

    return wfs.run_wait_for_shards(cli.build_parser().parse_args(["wait-for-shards", *argv]), env=env)


def test_shard_addresses():
    assert servers_from_env({"CGX_PS_SERVERS": "s-{i}.s:7070", "CGX_PS_NUM_SHARDS": "3"}) == (
        "s-0.s:7070", "s-1.s:7070", "s-2.s:7070")
    assert servers_from_env({"CGX_PS_SERVERS": "a:1, b:2"}) == ("a:1", "b:2")
    for bad in ({"CGX_PS_SERVERS": "a:1,b:2", "CGX_PS_NUM_SHARDS": "3"}, {"CGX_PS_SERVERS": "s-{i}:1"},
                {"CGX_PS_SERVERS": "nohostport"}, {}):
        with pytest.raises(ValueError):
            servers_from_env(bad)
    assert wait_main({}) == 2
    assert wait_main({}, "--servers", "a:1,b:2", "--num-shards", "3") == 2


@pytest.fixture
def health_server():
    import grpc
    from concurrent import futures
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    yield f"127.0.0.1:{port}", servicer, health_pb2
    server.stop(None)


def test_wait_for_shards_waits_for_serving(health_server):
    address, servicer, health_pb2 = health_server
    lines: list[str] = []
    assert wfs.wait([address], timeout=0.5, interval=0.1, rpc_timeout=0.5, log=lines.append) is False
    assert "NOT_SERVING" in lines[-1]
    timer = threading.Timer(0.5, servicer.set, ("", health_pb2.HealthCheckResponse.SERVING))
    timer.start()
    try:
        t0 = time.monotonic()
        assert wfs.wait([address], timeout=10, interval=0.1, rpc_timeout=0.5, log=lines.append)
        assert time.monotonic() - t0 < 5
    finally:
        timer.cancel()


def test_wait_for_shards_times_out_on_a_missing_shard(health_server):
    address, servicer, health_pb2 = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    lines: list[str] = []
    # 127.0.0.1:1 refuses connections: UNAVAILABLE, named in the last line.
    assert wfs.wait([address, "127.0.0.1:1"], timeout=1, interval=0.2, rpc_timeout=0.3,
                    log=lines.append) is False
    assert "127.0.0.1:1 (UNAVAILABLE)" in lines[-1]


def test_wait_for_shards_command_as_the_init_container_runs_it(health_server):
    """The CLI in a process of its own: exit 0 once SERVING, 1 naming the missing shard on
    timeout, and no torch imported (the init container's memory limit is 256 MiB)."""
    address, servicer, health_pb2 = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    init = container(worker_job("base"), "wait-for-shards", init=True)
    script = ("import sys; from cgx_ps.cli import main; rc = main(sys.argv[1:]); "
              "assert 'torch' not in sys.modules, 'wait-for-shards imported torch'; sys.exit(rc)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_PS_")}

    def run(servers: str) -> subprocess.CompletedProcess:
        args = [*init["args"], "--timeout", "2", "--interval", "0.2"]
        return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60,
                              env={**env, "CGX_PS_SERVERS": servers})

    ok = run(address)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"{address} is SERVING" in ok.stdout
    late = run(f"{address},127.0.0.1:1")
    assert late.returncode == 1, late.stdout + late.stderr
    assert "still waiting for 127.0.0.1:1 (UNAVAILABLE)" in late.stdout.splitlines()[-1]


@pytest.fixture
def tls_health_server(pki):
    """A gRPC health server with the shard certificate, requiring client certificates."""
    import grpc
    from concurrent import futures
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    shard = pki["shard"]
    creds = grpc.ssl_server_credentials([(shard["tls.key"], shard["tls.crt"])], root_certificates=shard["ca.crt"],
                                        require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_wait_for_shards_speaks_mtls_like_the_workers(tls_health_server, pki, tmp_path):
    """The init container's TLS environment (cpu-local-tls) reaches a shard that requires
    client certificates; without the client certificate, or checking the dialled name
    instead of CGX_PS_TLS_SERVER_NAME, it does not."""
    rel = "overlays/cpu-local-tls"
    init = container(worker_job(rel), "wait-for-shards", init=True)
    env = materialize(container_env(rel, init, DOWNWARD), tmp_path / "pod", pki["worker"])
    env["CGX_PS_SERVERS"] = tls_health_server
    env.pop("CGX_PS_NUM_SHARDS")
    assert wfs.run_wait_for_shards(init_args(init, "--timeout", "10", "--interval", "0.2"), env=env) == 0

    quiet = dict(timeout=0.6, interval=0.2, rpc_timeout=0.5, log=lambda s: None)
    security = ChannelSecurity.from_env(env)
    assert wfs.wait([tls_health_server], security=security, **quiet)
    no_client_cert = ChannelSecurity(tls_ca=env["CGX_PS_TLS_CA"], server_name=env["CGX_PS_TLS_SERVER_NAME"])
    assert not wfs.wait([tls_health_server], security=no_client_cert, **quiet)
    assert not wfs.wait([tls_health_server], **quiet)                       # plaintext
    # The dialled name is not in the certificate, and gRPC refuses a "*.cgx-ps-shard" wildcard
    # (one label after the star): hence CGX_PS_TLS_SERVER_NAME.
    for name in ("cgx-ps-shard-0.cgx-ps-shard", "cgx-ps-shard.other"):
        other = ChannelSecurity.from_env({**env, "CGX_PS_TLS_SERVER_NAME": name})
        assert not wfs.wait([tls_health_server], security=other, **quiet), name
    assert not grpc_name_matches("cgx-ps-shard-0.cgx-ps-shard", ["*.cgx-ps-shard"])
    assert grpc_name_matches("cgx-ps-shard-0.cgx-ps-shard.ns.svc", ["*.cgx-ps-shard.ns.svc"])
    # A half-configured client certificate is a configuration error (exit 2), by name.
    assert wait_main({**env, "CGX_PS_TLS_KEY": ""}, "--timeout", "1") == 2
    assert wait_main({**env, "CGX_PS_TLS_CA": str(tmp_path / "missing.crt")}, "--timeout", "1") == 2
