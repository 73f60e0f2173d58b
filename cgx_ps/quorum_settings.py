"""A job's quorum settings (CGX_PS_QUORUM, CGX_PS_GRACE_MS), checked alike by the worker at
``init()`` and by the shard at Register (server/rounds/quorum.py has what they do)."""

from __future__ import annotations

__all__ = ["DEFAULT_GRACE_MS", "MAX_GRACE_MS", "quorum_problem"]

DEFAULT_GRACE_MS = 50  # about a step's jitter on the clusters cgx-ps is for; a stall is seconds
MAX_GRACE_MS = 60_000  # a grace longer than a minute is a round timeout, not a grace


def quorum_problem(quorum: int, grace_ms: int, num_nodes: int) -> str | None:
    """Why (``quorum``, ``grace_ms``) cannot be the quorum settings of a job of ``num_nodes``
    nodes; None if they can (quorum 0: every node, no quorum)."""
    if not 0 <= quorum <= num_nodes:
        return (f"CGX_PS_QUORUM={quorum}: must be a number of nodes in 1..{num_nodes} (the job's nodes), "
                f"or 0 for all of them")
    if not 0 <= grace_ms <= MAX_GRACE_MS:
        return f"CGX_PS_GRACE_MS={grace_ms}: must be in 0..{MAX_GRACE_MS} milliseconds"
    return None
