"""Broadcast from one rank to all through the shards' blob stores (striped: a part on each), in a format that cannot execute code."""
