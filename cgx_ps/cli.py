"""The ``cgx-ps`` command line: long-running shards, a local cluster, and the demo.

    cgx-ps server  --port 7070 --shard-index 0 --num-shards 2     one shard (one process)
    cgx-ps cluster --shards 2                                      N local shards, Ctrl-C stops all
    cgx-ps demo    --workers 2 --shards 2 [--local-ranks 1]        shards + workers train a model
    cgx-ps codec-demo                                              codec sizes, error and speed

Every option that a deployment sets has an environment variable (CGX_PS_*), so Kubernetes
manifests can set it from a ConfigMap or the downward API without repeating it in args.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from .server.config import DEFAULT_METRICS_PORT, DEFAULT_PORT, SETTINGS, flag_defaults

__all__ = ["build_parser", "main", "DEFAULT_PORT", "DEFAULT_METRICS_PORT"]


def _add_server_options(p: argparse.ArgumentParser, *, per_shard: bool) -> None:
    """A shard's settings as flags (server/config.py's SETTINGS), their defaults from the
    environment; ``per_shard``: also those that differ between the shards of a cluster."""
    try:
        defaults = flag_defaults(os.environ)
    except ValueError as exc:
        raise SystemExit(f"cgx-ps: {exc}") from None
    security = p.add_argument_group("security (docs/security.md)")
    for name, s in SETTINGS.items():
        if s.per_shard and not per_shard:
            continue
        group = security if s.security else p
        if s.kind is bool:
            group.add_argument(s.flag, action="store_true", default=defaults[name], help=f"{s.help} (env {s.env})")
        else:
            default = "; default %(default)s" if defaults[name] != "" else ""
            group.add_argument(s.flag, type=s.kind, default=defaults[name], choices=s.choices or None,
                               help=f"{s.help} (env {s.env}{default})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cgx-ps", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    server = sub.add_parser("server", help="run one parameter-server shard")
    _add_server_options(server, per_shard=True)
    server.add_argument("--port-file", default=None,
                        help="write the bound gRPC and metrics ports here as JSON once serving")

    cluster = sub.add_parser("cluster", help="run N local shard processes until Ctrl-C/SIGTERM")
    cluster.add_argument("--shards", type=int, default=2)
    cluster.add_argument("--host", default="127.0.0.1")
    cluster.add_argument("--base-port", type=int, default=DEFAULT_PORT,
                         help="shard i listens on base-port + i (default %(default)s)")
    cluster.add_argument("--metrics-base-port", type=int, default=-1,
                         help="shard i serves metrics on this + i; -1 disables (default)")
    _add_server_options(cluster, per_shard=False)

    demo = sub.add_parser("demo", help="local cluster: shards plus workers training a real model")
    demo.add_argument("--workers", type=int, default=2, help="worker processes (default %(default)s)")
    demo.add_argument("--shards", type=int, default=2, help="shard processes (default %(default)s)")
    demo.add_argument("--local-ranks", type=int, default=1,
                      help="workers per node: they reduce through shared memory first, and each node pushes "
                           "every block once (must divide --workers; default %(default)s)")
    demo.add_argument("--epochs", type=int, default=8)
    demo.add_argument("--batch-size", type=int, default=32, help="per worker")
    demo.add_argument("--compression", default="4bit",
                      help="fp32, fp16, Nbit (N in 1..8) or adaptive (default %(default)s)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="plain log lines, no progress bar")

    codec = sub.add_parser("codec-demo", help="encode a random gradient: sizes, error and speed")
    codec.add_argument("--numel", type=int, default=25_000_000)
    codec.add_argument("--bucket-size", type=int, default=1024)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "server":
        from .server.main import run_server

        return run_server(args)
    if args.command == "cluster":
        from .server.cluster import run_cluster

        return run_cluster(args)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    if args.command == "codec-demo":
        from .codec_demo import run_codec_demo

        return run_codec_demo(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
