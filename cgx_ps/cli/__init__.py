"""The ``cgx-ps`` command line: shards, a local cluster, a look at running shards, the demo."""

from .commands import build_parser, main

__all__ = ["build_parser", "main"]
