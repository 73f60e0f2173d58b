"""The shard process's open-file limit (RLIMIT_NOFILE), raised at start to what its caps need.

Every connection a shard holds is a file descriptor: on the gRPC port, honest workers hold at
most one per call under ``--max-concurrent-rpcs`` (a member's channel carries all its calls); the
raw data plane (``--data-port``) holds up to as many streams again, and as many connections
waiting for their preface (server/rpc/raw_listener.py's ``max_pending``). Past the limit, accept()
fails with EMFILE: gRPC's core logs and retries its accept in a loop, asyncio's server stops
accepting for a while, and the workers that reconnect after a restart, all at once, are the
ones refused. A shard's default caps (1024 calls) already exceed the common soft limit of 1024,
which is what containers now start with: containerd (containerd#8924) and Docker (moby#45534)
dropped their raised limits for systemd's default of 1024 soft, 524288 hard, leaving it to a
program that needs more descriptors to raise its own soft limit.

So ``run_server`` raises the soft limit as far as the caps need (never past the hard limit, which
only root may raise). When even the hard limit is too low it raises the soft limit to the hard
one and warns, naming the numbers and the flag that lowers the need: the caps are ceilings against
hostile or runaway clients, an honest job holds a few connections per node, and a plain
``cgx-ps server`` (1024 calls) on a host whose hard limit is 1024 must start. Only for the shard
process, as server/process/allocator.py: a library must not change its host process's limits.
"""

from __future__ import annotations

import enum
import resource
from dataclasses import dataclass

from ..config import HEALTH_PORT_CALLS, MIN_CONCURRENT_RPCS, ServerConfig

__all__ = ["FdAction", "FdLimit", "RESERVED_FDS", "decide_fd_limit", "fds_needed", "raise_fd_limit"]

# Descriptors a shard holds besides its connections: an idle shard with metrics and the data plane
# holds 24 (listening sockets, epoll/eventfd/io_uring of gRPC and the loop, pipes, stdio); a scrape,
# the numba cache's files and the health port's few calls come and go on top.
RESERVED_FDS = 64


class FdAction(enum.Enum):
    KEEP = "keep"  # the soft limit already covers the need
    RAISE = "raise"  # set the soft limit to ``FdLimit.soft``
    SHORT = "short"  # even the hard limit is below the need: run at the hard limit, and warn


@dataclass(frozen=True)
class FdLimit:
    action: FdAction
    needed: int
    soft: int  # the soft limit to run with
    problem: str = ""  # what the shard may refuse at its caps, and what to change (SHORT)


def fds_needed(config: ServerConfig) -> int:
    """Descriptors the shard may hold at its caps: the gRPC port's calls, the data plane's
    streams and pending connections, the health port's calls, and ``RESERVED_FDS``."""
    calls = config.max_concurrent_rpcs
    plane = 2 * calls if config.data_port >= 0 else 0
    health = HEALTH_PORT_CALLS if config.health_port >= 0 else 0
    return RESERVED_FDS + calls + plane + health


def decide_fd_limit(config: ServerConfig, soft: int, hard: int) -> FdLimit:
    """What to do with the limits (``soft``, ``hard``; ``resource.RLIM_INFINITY`` for none) for a
    shard configured as ``config``."""
    needed = fds_needed(config)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return FdLimit(FdAction.KEEP, needed, soft)
    if hard == resource.RLIM_INFINITY or hard >= needed:
        return FdLimit(FdAction.RAISE, needed, needed)
    per_call = 3 if config.data_port >= 0 else 1
    fits = (hard - (needed - per_call * config.max_concurrent_rpcs)) // per_call
    lower = f" or lower --max-concurrent-rpcs to {fits} or less" if fits >= MIN_CONCURRENT_RPCS else ""
    plane = (" (as many calls on the gRPC port, streams on the data plane and connections waiting there for "
             "their preface: --data-port)" if config.data_port >= 0 else "")
    return FdLimit(FdAction.SHORT, needed, hard, problem=(
        f"the open-file limit is too low for the caps: --max-concurrent-rpcs {config.max_concurrent_rpcs} needs "
        f"up to {needed} file descriptors{plane}, but the hard limit (ulimit -Hn) is {hard}; the shard runs with "
        f"{hard} and refuses connections past them. Raise the hard limit (LimitNOFILE, docker --ulimit nofile, "
        f"the container runtime's default){lower}"))


def raise_fd_limit(config: ServerConfig) -> FdLimit:
    """Apply ``decide_fd_limit`` to this process: raise the soft limit where needed (to the hard
    limit when short; its caller warns with ``problem``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    decision = decide_fd_limit(config, soft, hard)
    if decision.action is not FdAction.KEEP and decision.soft > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (decision.soft, hard))
        except (OSError, ValueError) as exc:  # e.g. macOS caps it below the hard limit (kern.maxfilesperproc)
            return FdLimit(FdAction.SHORT, decision.needed, soft, problem=(
                f"cannot raise the open-file limit from {soft} to the {decision.soft} file descriptors "
                f"--max-concurrent-rpcs {config.max_concurrent_rpcs} needs: {exc}; the shard runs with {soft} and "
                f"refuses connections past them; lower --max-concurrent-rpcs"))
    return decision
