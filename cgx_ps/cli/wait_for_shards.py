"""``cgx-ps wait-for-shards``: wait until every shard reports SERVING on the gRPC health service.

    cgx-ps wait-for-shards --timeout 1800       shards from CGX_PS_SERVERS (+ CGX_PS_NUM_SHARDS)

The worker pods run it as their init container (deploy/base/worker-job.yaml), so training
starts only once all shards are up, and a late shard is named in the log rather than showing
up as a failed first round; scripts can run it before starting workers. It reads the shard
list the way workers do (``cgx_ps.net.addresses``) and connects the way they do
(``ChannelSecurity``: CGX_PS_TLS_CA, CGX_PS_TLS_CERT/KEY, CGX_PS_TLS_SERVER_NAME). The health
service needs no token. Imports no torch: the init container has 256 MiB.

Exit status: 0 once all shards are SERVING, 1 on timeout, 2 on a bad configuration.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..net.addresses import parse_servers
from ..net.security import ChannelSecurity, CredentialError

__all__ = ["check_health", "health_status", "resolve", "run_wait_for_shards", "wait"]

PLAINTEXT = ChannelSecurity()


def check_health(channel: grpc.Channel, rpc_timeout: float) -> tuple[str, str]:
    """(overall health status name, "") — SERVING, NOT_SERVING, ... — or, when it could not be
    read, (the gRPC status code name, its details, never empty): UNAVAILABLE when nothing
    listens, ..."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                          timeout=rpc_timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), ""
    except grpc.RpcError as err:
        if hasattr(err, "code"):
            return err.code().name, err.details() or "no details"
        return "UNKNOWN", str(err) or "no details"


def health_status(address: str, rpc_timeout: float, security: ChannelSecurity = PLAINTEXT) -> str:
    """The shard's health status name, or the gRPC status code name saying why it is unknown."""
    try:
        with security.sync_channel(address) as channel:
            return check_health(channel, rpc_timeout)[0]
    except CredentialError as err:  # e.g. a certificate file replaced mid-read
        return f"credentials: {err}"


def wait(addresses: Sequence[str], timeout: float, interval: float = 2.0, rpc_timeout: float = 2.0,
         log: Callable[[str], None] = print, security: ChannelSecurity = PLAINTEXT) -> bool:
    """Poll until every address is SERVING (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    pending = {address: "not checked" for address in addresses}
    last_report = 0.0
    while True:
        for address in list(pending):
            status = health_status(address, rpc_timeout, security)
            if status == "SERVING":
                del pending[address]
                log(f"wait-for-shards: {address} is SERVING")
            else:
                pending[address] = status
        if not pending:
            log(f"wait-for-shards: all {len(addresses)} shards are SERVING")
            return True
        now = time.monotonic()
        waiting = ", ".join(f"{a} ({s})" for a, s in pending.items())
        if now >= deadline:
            log(f"wait-for-shards: gave up after {timeout:g}s; still waiting for {waiting}")
            return False
        if now - last_report >= 10.0:
            log(f"wait-for-shards: waiting for {len(pending)} of {len(addresses)} shards: {waiting}")
            last_report = now
        time.sleep(min(interval, max(0.0, deadline - now)))


def resolve(command: str, args: argparse.Namespace,
            env: Mapping[str, str] | None) -> tuple[tuple[str, ...], ChannelSecurity] | None:
    """The shards ``args`` (--servers, --num-shards) or else ``env`` (default: ``os.environ``)
    name, and how to reach them (as workers do); None after one line on stderr, prefixed with
    ``command``, naming what is wrong (a bad shard list, a missing or malformed credential file):
    the command then exits 2."""
    env = os.environ if env is None else env
    spec = args.servers if args.servers is not None else env.get("CGX_PS_SERVERS", "")
    count = args.num_shards if args.num_shards is not None else env.get("CGX_PS_NUM_SHARDS", "")
    try:
        addresses = parse_servers(spec, str(count))
        security = ChannelSecurity.from_env(env)
        security.check()  # a missing or malformed file fails now, by name
    except ValueError as err:  # a CredentialError too
        print(f"{command}: {err}", file=sys.stderr)
        return None
    return addresses, security


def run_wait_for_shards(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    """``cgx-ps wait-for-shards``: poll every shard's gRPC health service until all answer
    SERVING (no token needed), saying which are still missing.

    Args:
        args: the parsed flags of ``cgx-ps wait-for-shards`` (the shard list, ``--timeout``,
            ``--interval``).
        env: where the shard list and TLS settings are read (default: ``os.environ``).

    Returns:
        The exit status: 0 when all are SERVING, 1 at the timeout, 2 for a bad shard list or
        TLS setting (said on stderr).
    """
    resolved = resolve("cgx-ps wait-for-shards", args, env)
    if resolved is None:
        return 2
    addresses, security = resolved
    ok = wait(addresses, args.timeout, args.interval, security=security,
              log=lambda line: print(line, flush=True))
    return 0 if ok else 1
