#!/usr/bin/env python3
"""Wait until every cgx-ps shard reports SERVING on the standard gRPC health service.

The worker pods run this as an init container (deploy/base/worker-job.yaml), so that
training starts only once all shards are up, and a late shard is named in the log rather
than showing up as a failed first round. It reads the shard list the way the worker
library does:

    CGX_PS_SERVERS     comma-separated host:port list, or one template containing "{i}",
                       expanded for i in range(CGX_PS_NUM_SHARDS)
    CGX_PS_NUM_SHARDS  number of shards

and connects the way the workers do when the shards serve TLS (deploy/optional/tls):

    CGX_PS_TLS_CA           CA bundle that signed the shards' certificates (TLS is on when set)
    CGX_PS_TLS_CERT, _KEY   client certificate and key, for shards that require one (mTLS)
    CGX_PS_TLS_SERVER_NAME  name to check in the shards' certificate instead of the host

cgx_ps.security.ChannelSecurity, the workers' own code, reads them. The health service
needs no bearer token.

Exit status: 0 once all shards are SERVING, 1 on timeout, 2 on a bad configuration.
Runs in the cgx-ps image: needs grpcio, grpcio-health-checking and cgx_ps.security.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# How the workers open channels (TLS, client certificate, checked server name), so this
# check connects exactly the way training will.
from cgx_ps.security import ChannelSecurity, CredentialError

PLAINTEXT = ChannelSecurity()


def shard_addresses(env: Mapping[str, str]) -> list[str]:
    """The shard addresses named by CGX_PS_SERVERS and CGX_PS_NUM_SHARDS in ``env``."""
    servers = env.get("CGX_PS_SERVERS", "").strip()
    if not servers:
        raise ValueError("CGX_PS_SERVERS is not set")
    raw_count = env.get("CGX_PS_NUM_SHARDS", "").strip()
    count = int(raw_count) if raw_count else None
    if "{i}" in servers:
        if count is None or count < 1:
            raise ValueError(f"CGX_PS_SERVERS={servers!r} is a template, so CGX_PS_NUM_SHARDS must be >= 1")
        return [servers.replace("{i}", str(i)) for i in range(count)]
    addresses = [s.strip() for s in servers.split(",") if s.strip()]
    if count is not None and count != len(addresses):
        raise ValueError(f"CGX_PS_SERVERS names {len(addresses)} shards but CGX_PS_NUM_SHARDS={count}")
    return addresses


def check(address: str, rpc_timeout: float, security: ChannelSecurity = PLAINTEXT) -> str:
    """The shard's overall health status name, or a short reason it could not be read."""
    try:
        with security.sync_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=rpc_timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as err:
        return err.code().name if hasattr(err, "code") else str(err)
    except CredentialError as err:  # e.g. a certificate file replaced mid-read
        return f"credentials: {err}"


def wait(addresses: Sequence[str], timeout: float, interval: float = 2.0,
         rpc_timeout: float = 2.0, log=print, security: ChannelSecurity = PLAINTEXT) -> bool:
    """Poll until every address is SERVING (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    pending = {address: "not checked" for address in addresses}
    last_report = 0.0
    while True:
        for address in list(pending):
            status = check(address, rpc_timeout, security)
            if status == "SERVING":
                del pending[address]
                log(f"wait-for-shards: {address} is SERVING")
            else:
                pending[address] = status
        if not pending:
            log(f"wait-for-shards: all {len(addresses)} shards are SERVING")
            return True
        now = time.monotonic()
        if now >= deadline:
            log("wait-for-shards: gave up; still waiting for "
                + ", ".join(f"{a} ({s})" for a, s in pending.items()))
            return False
        if now - last_report >= 10.0:
            log(f"wait-for-shards: waiting for {len(pending)} of {len(addresses)} shards: "
                + ", ".join(f"{a} ({s})" for a, s in pending.items()))
            last_report = now
        time.sleep(min(interval, max(0.0, deadline - now)))


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds to wait in all before failing (default %(default)s)")
    parser.add_argument("--interval", type=float, default=2.0,
                        help="seconds between polls (default %(default)s)")
    args = parser.parse_args(argv)
    env = os.environ if env is None else env
    try:
        addresses = shard_addresses(env)
        security = ChannelSecurity.from_env(env)
        security.check()  # a missing or malformed file fails now, by name
    except ValueError as err:  # CredentialError is one
        print(f"wait-for-shards: {err}", file=sys.stderr)
        return 2
    return 0 if wait(addresses, args.timeout, args.interval, security=security) else 1


if __name__ == "__main__":
    sys.exit(main())
