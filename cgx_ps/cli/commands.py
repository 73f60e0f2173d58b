"""The cgx-ps command line: shards, a local cluster, a look at running shards, and the demo.

    cgx-ps demo    --workers 2 --shards 2 [--local-ranks 1]        shards + workers train a model
    cgx-ps cluster --shards 2                                      N local shards, Ctrl-C stops all
    cgx-ps server  --port 7070 --shard-index 0 --num-shards 2     one shard (one process)
    cgx-ps status  [--watch] [--json]                              one line per shard (CGX_PS_SERVERS)
    cgx-ps wait-for-shards --timeout 600                           until every shard is SERVING
    cgx-ps codec-demo                                              codec sizes, error and speed

Every option that a deployment sets has an environment variable (CGX_PS_*), so Kubernetes
manifests can set it from a ConfigMap or the downward API without repeating it in args.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import MutableMapping, Sequence

from ..envparse import Bounds
from ..planning.command import add_parser as add_plan_parser

# Everything else is imported by build_parser or a command, inside main's Ctrl-C handling: a
# terminal's Ctrl-C reaches a `cgx-ps cluster`'s shards wherever they are in their start-up.

__all__ = ["build_parser", "main"]

MAX_PORT = 65535
MAX_COUNT = (1 << 31) - 1  # counts (workers, epochs, elements) that a C int and a host can hold
MAX_SECONDS = 7 * 86400.0  # a wait longer than a week is a typo


def _bounded(bounds: Bounds, name: str = "integer"):
    """An argparse type: a number within ``bounds`` (envparse.Bounds, the one check of every number
    a user sets). A bad one is a usage error naming the flag: one line, exit status 2."""
    def parse(text: str) -> int | float:
        try:
            return bounds.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc}, got {text!r}") from None
    parse.__name__ = name  # argparse names the type in its message: "invalid integer value"
    return parse


def _at_least(minimum: int, maximum: int = MAX_COUNT):
    """An argparse type: an integer in ``minimum``..``maximum`` (a bad count is a usage error)."""
    return _bounded(Bounds(minimum, maximum))


def _port(off: int | None = None):
    """An argparse type: a TCP port, 0 (pick a free one) to 65535, or ``off`` (disabled)."""
    return _bounded(Bounds(0, MAX_PORT, off=off), "port")


def _bucket_size(text: str) -> int:
    """An argparse type: elements per max-min bucket, as the codec accepts them."""
    from ..kernels.wire import MAX_BUCKET_SIZE, Codec, CodecError, validate_settings

    value = _at_least(8, MAX_BUCKET_SIZE)(text)
    try:
        validate_settings(Codec.MAXMIN, 8, value)
    except CodecError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("bucket_size ")) from None
    return value


def _compression(text: str) -> str:
    """An argparse type: a compression the workers accept, checked before any process starts."""
    from ..worker.errors import ConfigError
    from ..worker.pipeline.blocks import Compression

    try:
        Compression.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _seconds(zero: bool = False):
    """An argparse type: seconds > 0 (or >= 0 where ``zero`` means something)."""
    return _bounded(Bounds(0, MAX_SECONDS, integer=False, above=not zero, unit="seconds"), "number of seconds")


def _add_server_options(p: argparse.ArgumentParser, *, per_shard: bool) -> None:
    """A shard's settings as flags (server/config.py's SETTINGS), their defaults from the
    environment; ``per_shard``: also those that differ between the shards of a cluster."""
    from ..server.config import SETTINGS, flag_defaults

    try:
        defaults = flag_defaults(os.environ)
    except ValueError as exc:  # a usage error, as a bad flag is (argparse's exit status 2)
        print(f"cgx-ps: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    security = p.add_argument_group("security (docs/security.md)")
    for name, s in SETTINGS.items():
        if s.per_shard and not per_shard:
            continue
        group = security if s.security else p
        if s.kind is bool:
            group.add_argument(s.flag, action="store_true", default=defaults[name], help=f"{s.help} (env {s.env})")
        else:
            default = "; default %(default)s" if defaults[name] != "" else ""
            # an int setting with no default (the metrics port: 9400 + the shard index) is None
            value = None if defaults[name] == "" and s.kind is not str else defaults[name]
            kind = _bounded(s.bounds, s.kind.__name__) if s.bounds is not None else s.kind
            group.add_argument(s.flag, type=kind, default=value, choices=s.choices or None,
                               help=f"{s.help} (env {s.env}{default})")


def _add_shard_list_options(p: argparse.ArgumentParser) -> None:
    # Read at run time (cgx_ps.cli.wait_for_shards.resolve), so the environment the command runs in counts.
    p.add_argument("--servers", default=None,
                   help="shard addresses host:port,... or a template with {i} (default: env CGX_PS_SERVERS)")
    p.add_argument("--num-shards", default=None,
                   help="shard count, expands a {i} template (default: env CGX_PS_NUM_SHARDS)")


def build_parser() -> argparse.ArgumentParser:
    from ..server.config import DEFAULT_PORT, flag_defaults

    summary, _, rest = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(prog="cgx-ps", description=summary, epilog=rest,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_plan_parser(sub)

    server = sub.add_parser("server", help="run one parameter-server shard")
    _add_server_options(server, per_shard=True)
    server.add_argument("--port-file", default=None,
                        help="write the bound gRPC and metrics ports here as JSON once serving")

    cluster = sub.add_parser("cluster", help="run N local shard processes until Ctrl-C/SIGTERM")
    cluster.add_argument("--shards", type=_at_least(1), default=2, help="shard processes (default %(default)s)")
    cluster.add_argument("--host", default="127.0.0.1",
                         help="address the shards bind (default %(default)s: this machine only)")
    cluster.add_argument("--base-port", type=_port(), default=DEFAULT_PORT,
                         help="shard i listens on base-port + i (default %(default)s)")
    cluster.add_argument("--metrics-base-port", type=_port(off=-1), default=-1,
                         help="shard i serves metrics on this + i; -1 disables (default)")
    _add_server_options(cluster, per_shard=False)
    # CGX_PS_DATA_PORT / CGX_PS_HEALTH_PORT name the base here: as a shard's own port, every shard
    # of the cluster would try to bind the same one
    env = flag_defaults(os.environ)  # valid: _add_server_options exits on a malformed variable
    cluster.add_argument("--data-base-port", type=_port(off=-1),
                         default=None if env["data_port"] == "" else env["data_port"],
                         help="shard i's raw data plane (an opt-in for trusted networks) listens on this + i; "
                              "0: a free port each; -1: off (env CGX_PS_DATA_PORT; default: off)")
    cluster.add_argument("--health-base-port", type=_port(off=-1), default=env["health_port"],
                         help="shard i serves a plaintext health-only port on this + i; 0: a free port each; "
                              "-1: off (env CGX_PS_HEALTH_PORT; default %(default)s)")

    demo = sub.add_parser("demo", help="local cluster: shards plus workers training a real model")
    demo.add_argument("--workers", type=_at_least(1), default=2, help="worker processes (default %(default)s)")
    demo.add_argument("--shards", type=_at_least(1), default=2, help="shard processes (default %(default)s)")
    demo.add_argument("--local-ranks", type=_at_least(1), default=1,
                      help="workers per node: they reduce through shared memory first, and each node pushes "
                           "every block once (must divide --workers; default %(default)s)")
    demo.add_argument("--epochs", type=_at_least(1), default=8, help="passes over the training data (default %(default)s)")
    demo.add_argument("--batch-size", type=_at_least(1), default=32, help="per worker")
    demo.add_argument("--compression", type=_compression, default="4bit",
                      help="fp32, fp16, Nbit (N in 1..8) or adaptive (default %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="data order and initial weights (default %(default)s)")
    demo.add_argument("--no-progress", action="store_true", help="plain log lines, no progress bar")

    codec = sub.add_parser("codec-demo", help="encode a random gradient: sizes, error and speed")
    codec.add_argument("--numel", type=_at_least(1), default=25_000_000,
                       help="elements of the random gradient (default %(default)s: a 100 MB fp32 tensor)")
    codec.add_argument("--bucket-size", type=_bucket_size, default=1024,
                       help="elements per max-min bucket (default %(default)s)")

    status = sub.add_parser("status", help="one line per shard: health, session, rounds, bytes/s, last error",
                            description="Ask every shard how it is doing: health (open health service), then "
                                        "the Status RPC with the job token and TLS from the environment, as "
                                        "workers (CGX_PS_TOKEN_FILE, CGX_PS_TLS_*). Exit status: 0 all shards "
                                        "SERVING and answering, 1 otherwise, 2 bad configuration.")
    _add_shard_list_options(status)
    status.add_argument("--watch", type=_seconds(), nargs="?", const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2 when given) until Ctrl-C")
    status.add_argument("--json", action="store_true", help="one JSON object per refresh instead of a table")
    status.add_argument("--sample", type=_seconds(zero=True), default=1.0,
                        help="without --watch: seconds between the two samples that give the rates; 0: one "
                             "sample, no rates (default %(default)s)")
    status.add_argument("--timeout", type=_seconds(), default=3.0, help="seconds per call (default %(default)s)")

    wait = sub.add_parser("wait-for-shards", help="wait until every shard is SERVING (health service; no token)",
                          description="Wait until every shard answers SERVING on the gRPC health service. "
                                      "TLS from CGX_PS_TLS_CA/CERT/KEY/SERVER_NAME, as workers. Exit status: 0 "
                                      "all SERVING, 1 timeout, 2 bad configuration.")
    _add_shard_list_options(wait)
    wait.add_argument("--timeout", type=_seconds(), default=1800.0,
                      help="seconds to wait in all before failing (default %(default)s)")
    wait.add_argument("--interval", type=_seconds(), default=2.0, help="seconds between polls (default %(default)s)")
    return parser


def quiet_grpc_core(env: MutableMapping[str, str]) -> None:
    """For a shard: gRPC's C core logs in its own format to stderr, one INFO line per failed TLS
    handshake (a plaintext client, a stranger's certificate: anyone who can reach the port),
    neither structured nor rate-limited as the shard's own refusals are. ERROR keeps its errors;
    an operator's own GRPC_VERBOSITY wins. Set before grpc is imported: the core reads it then."""
    env.setdefault("GRPC_VERBOSITY", "ERROR")


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["server"]:
        quiet_grpc_core(os.environ)
    try:
        parser = build_parser()
        if not words:
            parser.print_help(sys.stderr)  # a first try with no arguments: the overview, not a usage error
            return 2
        args = parser.parse_args(words)
        problem = _port_range_problem(args)
        if problem:
            parser.error(problem)
        return args.command_run(args) if hasattr(args, "command_run") else _run(args)
    except KeyboardInterrupt:
        # Ctrl-C before a command installed its own handler: while parsing or importing (the
        # whole process group gets it, so a cluster's shards may be anywhere in their start-up)
        name = next((w for w in words if not w.startswith("-")), "")
        print(f"cgx-ps{' ' + name if name else ''}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`cgx-ps status --json | head`): stop quietly, as other tools do;
        # stdout goes to /dev/null so that flushing it at exit does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


def _port_range_problem(args: argparse.Namespace) -> str | None:
    """A cluster's shard i listens on base + i: every one of them must be a port."""
    if args.command != "cluster":
        return None
    for flag, base in (("--base-port", args.base_port), ("--metrics-base-port", args.metrics_base_port),
                       ("--data-base-port", args.data_base_port), ("--health-base-port", args.health_base_port)):
        if base is not None and base > 0 and base + args.shards - 1 > MAX_PORT:
            return f"{flag} {base} + {args.shards} shards goes past port {MAX_PORT}"
    return None


def _run(args: argparse.Namespace) -> int:
    if args.command == "server":
        from ..server.main import run_server

        return run_server(args)
    if args.command == "cluster":
        from ..server.cluster import run_cluster

        return run_cluster(args)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    if args.command == "codec-demo":
        from .codec_demo import run_codec_demo

        return run_codec_demo(args)
    if args.command == "status":
        from .status_table import run_status

        return run_status(args)
    if args.command == "wait-for-shards":
        from .wait_for_shards import run_wait_for_shards

        return run_wait_for_shards(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
