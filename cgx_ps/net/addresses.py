"""Where the shards are: CGX_PS_SERVERS, read one way by everyone who dials them.

    CGX_PS_SERVERS     "host:port,host:port" (index = shard index), or one template with {i}
    CGX_PS_NUM_SHARDS  the shard count: expands the template; must match a list's length

Workers (``cgx_ps.worker.config``), ``cgx-ps status`` and ``cgx-ps wait-for-shards`` (the
workers' init container on Kubernetes) all read the list here, so a template that works for
one works for all. Pure string handling: importing this pulls in nothing heavy.
"""

from __future__ import annotations

from typing import Mapping

from ..envparse import Bounds

__all__ = ["MAX_SHARDS", "SHARD_COUNT", "bare_host", "check_address", "host_port", "parse_servers", "servers_from_env"]

MAX_SHARDS = 1024  # more can only be a typo (a template would expand to that many addresses)
SHARD_COUNT = Bounds(1, MAX_SHARDS)  # CGX_PS_NUM_SHARDS, --num-shards


def bare_host(host: str) -> str:
    """``host`` without the brackets an IPv6 address wears before a port ("[::1]" -> "::1"): what
    sockets, asyncio and Python's HTTP server take."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_port(host: str, port: int) -> str:
    """host:port, an IPv6 address in brackets ("::1", 7070 -> "[::1]:7070"): what gRPC takes (it
    reads "::1:7070" as a name) and what an operator can paste into CGX_PS_SERVERS."""
    host = bare_host(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_address(address: str) -> None:
    """ValueError unless ``address`` is host:port (host may be a name, an IP or [IPv6])."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"shard address {address!r} is not host:port (from CGX_PS_SERVERS)")


def parse_servers(spec: str, num_shards: str = "") -> tuple[str, ...]:
    """The addresses ``spec`` (CGX_PS_SERVERS) names, checked; ValueError naming the variable."""
    spec, num_shards = spec.strip(), num_shards.strip()
    if num_shards:
        try:
            SHARD_COUNT.parse(num_shards)
        except ValueError as exc:
            raise ValueError(f"CGX_PS_NUM_SHARDS={num_shards!r}: {exc}") from None
    if "{i}" in spec:
        if not num_shards.isdigit() or int(num_shards) < 1:
            raise ValueError(f"CGX_PS_SERVERS={spec!r} is a template: set CGX_PS_NUM_SHARDS to the shard count")
        # replace, not str.format: other braces in a name are not ours to interpret
        servers = tuple(spec.replace("{i}", str(i)) for i in range(int(num_shards)))
    else:
        servers = tuple(s.strip() for s in spec.split(",") if s.strip())
        if num_shards.isdigit() and servers and int(num_shards) != len(servers):
            raise ValueError(f"CGX_PS_SERVERS lists {len(servers)} shards but CGX_PS_NUM_SHARDS={num_shards}")
    if not servers:
        raise ValueError("no shard addresses: set CGX_PS_SERVERS (e.g. 127.0.0.1:7070,127.0.0.1:7071)")
    for address in servers:
        check_address(address)
    return servers


def servers_from_env(env: Mapping[str, str]) -> tuple[str, ...]:
    return parse_servers(env.get("CGX_PS_SERVERS", ""), env.get("CGX_PS_NUM_SHARDS", ""))
