"""What a shard refuses, and why: the server's domain errors, free of any transport.

Admission, reassembly, aggregation and the blob store raise these; the gRPC layer turns each
class into one status code through one table (``rpc.STATUS_CODES``, listed in ps.proto's
header). The class says what kind of refusal it is, so a client knows whether to retry; the
message says exactly what was wrong, naming the field, the expected and the found value.
"""

from __future__ import annotations

__all__ = ["AlreadyExists", "BadRequest", "Busy", "Conflict", "Forbidden", "InternalError", "LimitExceeded",
           "NotMember", "ProtocolError", "SessionEnded", "ShuttingDown", "StreamAborted", "TimedOut",
           "Unauthenticated", "WITHHELD", "WrongRound", "shown", "without_tracebacks"]


class ProtocolError(Exception):
    """A call the shard refuses or a stream it ends. Raise a subclass: the class picks the status."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# ---- the request itself is wrong: sent again unchanged, it fails again ---------------------------


class BadRequest(ProtocolError):
    """Malformed or impossible: a bad message, payload, layout, chunk order, id or value."""


class AlreadyExists(ProtocolError):
    """A write that would replace different data (a blob key that holds other bytes)."""


# ---- the caller may not do this ------------------------------------------------------------------


class Unauthenticated(ProtocolError):
    """The call carries no valid job token."""


class NotMember(ProtocolError):
    """The caller is not a registered member of the shard's current session."""


class Forbidden(ProtocolError):
    """Not the caller's to touch: a session's blobs are its members' alone."""


# ---- the request does not fit the session's state ------------------------------------------------


class Conflict(ProtocolError):
    """The request disagrees with the session: another layout, node count or shard count, or
    one node more than the session has room for."""


class WrongRound(ProtocolError):
    """A push or codec change for a round its block is not at: stale, far-future, under way."""


class SessionEnded(ProtocolError):
    """The session the request belongs to has failed or ended."""


# ---- the shard ends the work or cannot take it now -----------------------------------------------


class StreamAborted(ProtocolError):
    """The shard ended the stream: its session ended (a failed round, a reset, another job), or
    a newer stream of the same member replaced it."""


class Busy(ProtocolError):
    """Another job holds the shard: retry until it is done."""


class ShuttingDown(ProtocolError):
    """The shard is draining for shutdown: no new calls, no new rounds."""


class LimitExceeded(ProtocolError):
    """A bound on memory or queued work was reached: a full budget, results left unread, too
    many scheduled codec changes, a full blob store."""


class TimedOut(ProtocolError):
    """What the shard waited for did not come in time: a stream's next message, a blob."""


class InternalError(ProtocolError):
    """A bug in the shard, reported without its traceback (the shard logs it)."""


WITHHELD = "(details withheld: this shard does not authenticate callers; see docs/security.md)"


def shown(text: str, authenticated: bool) -> str:
    """``text`` (it may name the job, tensors, shapes) for a shard whose callers proved they
    belong to the job; withheld otherwise, so a stranger learns nothing of the model."""
    return text if authenticated else WITHHELD


def without_tracebacks(error: ProtocolError) -> ProtocolError:
    """``error`` (and the exceptions it chains) stripped of their tracebacks, for a refusal kept
    while the call still waits on the client: a traceback keeps every frame it passed through
    alive with all their locals, such as a refused upload's buffer. The refusal's message is
    all the caller and the log are given, so nothing is lost."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        link = pending.pop()
        if link is None or id(link) in seen:  # a chain can loop back on itself
            continue
        seen.add(id(link))
        link.__traceback__ = None
        pending += [link.__cause__, link.__context__]
    return error
