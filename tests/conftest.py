"""Test-session setup: every shard and worker the tests start shares one job token."""

from __future__ import annotations

import os

from support import TOKEN_FILE

# Worker processes inherit the environment, and LocalCluster's shards take the job token it
# names: the tests run the secure default (a token on every call), not an open shard.
os.environ["CGX_PS_TOKEN_FILE"] = TOKEN_FILE
