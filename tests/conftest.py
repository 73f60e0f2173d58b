"""Test-session setup and the fixtures many test files share.

Every shard and worker the tests start shares one job token (support.TOKEN_FILE): the tests run
the secure default, not an open shard. ``start_shard`` starts in-process shards; a test file
sets its own defaults for them in a module-level ``SHARD_SETTINGS`` dict.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from cgx_ps.server import ServerConfig, ShardServer
from support import TOKEN_FILE

# Worker processes inherit the environment, and LocalCluster's shards take the job token it
# names.
os.environ["CGX_PS_TOKEN_FILE"] = TOKEN_FILE

# In-process shards: a free port, the job token, no metrics port, one kernel thread (the CI
# machine has two cores).
IN_PROCESS_SHARD = dict(host="127.0.0.1", port=0, metrics_port=-1, kernel_threads=1, token_file=TOKEN_FILE)


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
