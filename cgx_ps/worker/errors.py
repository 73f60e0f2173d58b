"""What the worker library raises: one small tree, so training loops can catch by kind."""

from __future__ import annotations

__all__ = ["CgxPsError", "ShardUnavailableError", "ShardRejectedError", "RoundFailedError",
           "ConfigError", "CollectiveStalledError", "IntraNodeError", "BroadcastError", "BlobFormatError",
           "CheckpointError", "StepAbandoned", "StreamEnded"]


class CgxPsError(RuntimeError):
    """Base of every error the worker library raises."""


class ConfigError(CgxPsError, ValueError):
    """The environment or arguments do not describe a usable job."""


class ShardUnavailableError(CgxPsError):
    """A shard could not be reached (after retries)."""


class ShardRejectedError(CgxPsError):
    """A shard refused a request; the message says why (layout mismatch, bad block, ...)."""

    def __init__(self, address: str, code: str, details: str) -> None:
        super().__init__(f"shard {address} refused: {code}: {details}")
        self.address, self.code, self.details = address, code, details


class RoundFailedError(CgxPsError):
    """A round failed on the shards for every node (for example a node missed the deadline)."""

    def __init__(self, address: str, message: str, missing_nodes: tuple[str, ...] = ()) -> None:
        super().__init__(f"round failed on shard {address}: {message}")
        self.address, self.missing_nodes = address, missing_nodes


class StreamEnded(CgxPsError):
    """An Exchange stream ended, on either data plane (worker/shards/exchange_call.py): ``code`` is
    the name of a ``grpc.StatusCode`` (the shard's status, UNAVAILABLE when the connection broke,
    CANCELLED when the worker cancelled the stream), ``details`` its words. The connection's
    supervisor decides from it whether to repair the stream (recovery.py); it does not reach
    training code, which sees the error that ends the job instead."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class CollectiveStalledError(CgxPsError):
    """An all_reduce on the process group (auto mode's uncompressed steps) did not finish within
    the round timeout: another rank stalled. Fatal for this rank: its group is out of step."""


class IntraNodeError(CgxPsError):
    """A local rank of this node died, stalled or disagreed (intra-node reduction)."""


class BroadcastError(CgxPsError):
    """A broadcast did not come from the root rank, could not be parsed, or does not fit the
    receiving rank's model or optimizer."""


class BlobFormatError(CgxPsError):
    """A value cannot be broadcast, or a received broadcast blob is corrupt or not one at all."""


class CheckpointError(CgxPsError, ValueError):
    """A saved cgx-ps state does not fit this job (another model layout, a damaged file) or was
    loaded at a moment it cannot take effect (after training steps)."""


class StepAbandoned(CgxPsError):
    """This step was abandoned by a rank whose backward failed part way (it called
    ``zero_grad()`` before ``step()``): no rank can complete it. Catch it, call ``zero_grad()``
    and go on with the next batch, as that rank does: every rank then skips the same step."""
