"""Test-session setup and the fixtures many test files share.

Every shard and worker the tests start shares one job token (support.TOKEN_FILE): the tests run
the secure default, not an open shard. ``start_shard`` starts in-process shards; a test file
sets its own defaults for them in a module-level ``SHARD_SETTINGS`` dict. ``local_cluster``
starts shard processes (a LocalCluster) for one test; ``cluster`` is one LocalCluster that a
test file's tests share, set by its module-level ``CLUSTER_SETTINGS`` dict.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from typing import Iterator, Sequence

import grpc
import pytest

from cgx_ps.server import LocalCluster, ServerConfig, ShardServer
from support import PLANES, TOKEN_FILE, plane_settings

# Worker processes inherit the environment, and LocalCluster's shards take the job token it
# names.
os.environ["CGX_PS_TOKEN_FILE"] = TOKEN_FILE

# In-process shards: a free port, the job token, no metrics port, one kernel thread (the CI
# machine has two cores).
IN_PROCESS_SHARD = dict(host="127.0.0.1", port=0, metrics_port=-1, kernel_threads=1, token_file=TOKEN_FILE)


# The emulated cluster's namespaces and bridge (benchmarks/netns.py, "cgxb-*") have fixed names,
# so two tests that build one at the same time (pytest-xdist runs files side by side) would
# collide, or find each other's as leftovers: the tests marked ``root`` take turns on this lock.
NETNS_LOCK = "/tmp/cgx-ps-tests-netns.lock"


@pytest.fixture(autouse=True)
def _one_emulated_cluster_at_a_time(request) -> Iterator[None]:
    if request.node.get_closest_marker("root") is None:
        yield
        return
    with open(NETNS_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture
async def start_shard(request):
    """``await start_shard(**settings)``: a ShardServer serving in this process, with
    IN_PROCESS_SHARD, then the test module's SHARD_SETTINGS, then ``settings``. Every shard a
    test started is stopped after it, also when the test failed halfway (a live gRPC server
    would keep the test process from exiting)."""
    started: list[ShardServer] = []
    module_settings = getattr(request.module, "SHARD_SETTINGS", {})

    async def start(**settings) -> ShardServer:
        server = ShardServer(ServerConfig(**{**IN_PROCESS_SHARD, **module_settings, **settings}))
        await server.start()
        started.append(server)
        return server

    yield start
    for server in reversed(started):
        try:
            await asyncio.wait_for(server.stop(drain=False), 10)
        except Exception:  # noqa: BLE001 - stopping a shard the test broke on purpose may fail too
            pass


@pytest.fixture
async def shard(start_shard) -> ShardServer:
    """One in-process shard with the module's settings."""
    return await start_shard()


@pytest.fixture
async def open_channel():
    """``open_channel(address, options=())``: a plaintext grpc.aio channel, closed after the test
    (also one it failed in) while the test's event loop still runs: a channel left to the
    garbage collector cancels its calls on a loop that may be closed by then."""
    opened: list[grpc.aio.Channel] = []

    def open_(address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        opened.append(grpc.aio.insecure_channel(address, options=list(options)))
        return opened[-1]

    yield open_
    for channel in opened:
        await channel.close()  # closing one closed already does nothing


class LocalClusters:
    """``clusters(shards=2, round_timeout=None, log_level="WARNING", extra_args=(), **config)``:
    a started LocalCluster whose shards run with ``--round-timeout`` (when given), ``--log-level``
    and ``extra_args``; ``config`` goes to LocalCluster (metrics_base_port, data_base_port, ...).
    ``stop()`` stops every cluster it started, also those a test stopped or broke itself."""

    def __init__(self) -> None:
        self.started: list[LocalCluster] = []

    def __call__(self, shards: int = 2, *, round_timeout: float | None = None, log_level: str = "WARNING",
                 extra_args: Sequence[str] = (), **config) -> LocalCluster:
        timeout = ["--round-timeout", str(round_timeout)] if round_timeout is not None else []
        cluster = LocalCluster(shards, extra_args=[*timeout, "--log-level", log_level, *extra_args], **config)
        self.started.append(cluster.start())  # a cluster that fails to start stops its shards itself
        return cluster

    def stop(self) -> None:
        # SIGTERM, then SIGKILL after 3 s: a shard drains the rounds in flight for up to its
        # --drain-timeout (20 s), and a test that killed a worker mid-round leaves one that never
        # finishes; no test looks at its shards after it, and a test of the drain stops them itself
        for cluster in reversed(self.started):
            cluster.stop(timeout_s=3)


@pytest.fixture
def local_cluster() -> Iterator[LocalClusters]:
    """``local_cluster(shards=2, **settings)`` (LocalClusters): shard processes for this test,
    stopped after it."""
    clusters = LocalClusters()
    yield clusters
    clusters.stop()


class PlaneClusters:
    """A test file's shards, one LocalCluster per data plane (``clusters[plane]``, with
    ``support.plane_settings``), each started when a test first asks for it: a file whose tests run
    on gRPC, a few of them on the raw plane too, starts the second cluster only for those."""

    def __init__(self, settings: dict) -> None:
        self.settings = settings
        self.started = LocalClusters()
        self._by_plane: dict[str, LocalCluster] = {}

    def __getitem__(self, plane: str) -> LocalCluster:
        if plane not in self._by_plane:
            self._by_plane[plane] = self.started(**self.settings, **plane_settings(plane))
        return self._by_plane[plane]


@pytest.fixture(scope="module")
def clusters(request) -> Iterator[PlaneClusters]:
    """The test file's shards per data plane (PlaneClusters), with its ``CLUSTER_SETTINGS``
    (LocalClusters' arguments): its tests share them (each runs its own job)."""
    started = PlaneClusters(getattr(request.module, "CLUSTER_SETTINGS", {}))
    yield started
    started.started.stop()


@pytest.fixture(scope="module")
def cluster(clusters: PlaneClusters) -> LocalCluster:
    """The test file's shards on the default data plane (gRPC), started once."""
    return clusters["grpc"]


@pytest.fixture(params=PLANES)
def plane(request) -> str:
    """The data plane a test's workers stream on, "grpc" then "raw" (support.PLANES): shards from
    ``clusters[plane]`` or ``local_cluster(..., **plane_settings(plane))``, workers with
    ``support.plane_env(plane)``. A test that takes it runs once per plane."""
    return request.param


# The files whose tests take longest (scripts/test.sh prints the slowest tests), longest first.
# `--dist loadfile` hands files to the test processes in collection order, each to the first one
# free: a long file collected last (test_worker.py, by its name) ran alone at the end while the
# other process idled. Handed out first, long files overlap each other and short ones fill in.
LONGEST_FILES = ("test_worker.py", "test_abandoned_step.py", "test_quorum.py", "test_quorum_tuning.py",
                 "test_quorum_local.py", "test_resilience.py",
                 "test_frameworks.py", "test_demo.py", "test_cold_start.py", "test_ddp_hook.py", "test_security.py",
                 "test_checkpoint.py", "test_cli.py", "test_dataplane.py", "test_autotune.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
