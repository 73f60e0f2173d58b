"""Broadcast from one rank to all through shard 0's blob store, in a format that cannot execute code."""
