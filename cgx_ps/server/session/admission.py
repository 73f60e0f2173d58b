"""Who may join this shard's session: the checks of a Register, and the decision it leads to.

The decision is a pure function of the session's state and the request, as in torch elastic's
rendezvous: ``admit`` says what to do, the service does it.

    Join()           add the member to the current session (also a retried Register)
    Restart(reason)  end the current session (``reason`` tells its members) and start a new one
    Refuse(error)    refuse the Register: Busy (another job; retry later) or Conflict (never)

Incarnations: which start of the job a process belongs to. Launchers count starts per node
(torchrun's TORCHELASTIC_RESTART_COUNT counts only its own agent's restarts, not those forced on
it by another node's failure; a replaced pod counts from 0), so no value a fresh process brings
is comparable across nodes. The shard counts instead: a session that replaces one of the same job
gets a higher incarnation (``session_incarnation``), handed to every member in RegisterResponse.

- A fresh process (``resume`` false) joins by the ordinary rules whatever its count: lower (a
  replaced pod) or higher than the session's (a node whose agent counted more restarts). Its count
  still says "the job restarted" at once where the rules would refuse or wait: a higher count from
  a node that cannot be a member of the current session (full, another node count or layout, its
  slot taken by a process that trained) starts a new one, as an elastic restart needs.
- A recovering process (``resume`` true, rejoining a restarted shard) brings the value the shard
  gave it. A lower one than the session's is of an earlier start that is still around: refused,
  so it can neither join nor reset the current session. A higher one finds a session that such
  a process started on the restarted shard (which lost its count): it replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...kernels.wire import HEADER_SIZE
from ...model_layout import LayoutError, first_difference, layout_hash, validate_layout
from ...v1 import ps_pb2
from ..config import ServerConfig
from ..errors import BadRequest, Busy, Conflict, ProtocolError, shown
from ...quorum_settings import quorum_problem
from .job_session import Session, owned_blocks

__all__ = ["Join", "MAX_ID_CHARS", "Refuse", "Restart", "admit", "check_registration", "session_incarnation"]

MAX_ID_CHARS = 256  # node and job ids: they appear in messages, metrics and gRPC status details
IDLE_JOBLESS_S = 10.0  # a session without a job id counts as finished after this long idle


@dataclass(frozen=True)
class Join:
    pass


@dataclass(frozen=True)
class Restart:
    reason: str


@dataclass(frozen=True)
class Refuse:
    error: ProtocolError


Admission = Join | Restart | Refuse


def admit(session: Session | None, request: ps_pb2.RegisterRequest, *, in_flight: int, now: float,
          authenticated: bool) -> Admission:
    """What a (checked) Register means for the shard's ``session``.

    ``in_flight``: block rounds and pushes under way on the shard; ``now``: time.monotonic();
    ``authenticated``: callers proved they belong to the job, so refusals may name its details.
    """
    node, job, member = request.node_id, request.job_id, request.member
    if session is None:
        return Restart("no session yet")
    if job == session.job_id and request.resume and request.incarnation < session.incarnation:
        return Refuse(Conflict(f"node {node} member {member} is of incarnation {request.incarnation} of the job, "
                               f"the shard serves its incarnation {session.incarnation}: a process left over from "
                               f"an earlier start of the job may not join (is it still running?)"))
    if job == session.job_id and request.resume and request.incarnation > session.incarnation:
        # this shard restarted and a process of an earlier start rejoined it first
        return Restart(f"node {node} of incarnation {request.incarnation} rejoins a session of the earlier "
                       f"incarnation {session.incarnation}")
    if job == session.job_id and not request.resume and request.incarnation > session.incarnation \
            and not _may_join(session, request):
        return Restart(f"job restarted: incarnation {request.incarnation} replaces {session.incarnation}")
    if session.failed is not None:
        return Restart("session reset after failure")
    idle = not session.streams and not in_flight
    if job != session.job_id:
        if idle:
            return Restart(f"job {job!r} replaces finished job {session.job_id!r}")
        which = f" ({session.job_id!r})" if authenticated else ""  # a stranger must not learn it
        return Refuse(Busy(f"shard is busy with another job{which}, {len(session.streams)} nodes connected; "
                           f"this job must wait or use other shards"))
    diff = first_difference(session.layout, request.layout)
    if member in session.nodes.get(node, ()):
        if session.started(node, member) or diff is not None:
            # the process restarted, so the job did: start over at round 0
            return Restart(f"session reset: node {node} member {member} registered again")
        return Join()  # a retried Register: idempotent
    if node in session.nodes and diff is None and request.num_nodes == session.num_nodes \
            and (request.quorum, request.grace_ms) == session.quorum_settings:
        return Join()  # another local rank of a known node
    if diff is not None and not job and idle and now - session.last_activity > IDLE_JOBLESS_S:
        return Restart("a new job (no job id) replaces an idle session")
    if diff is not None:
        return Refuse(Conflict(f"node {node} declares a different model layout than the session's: "
                               f"{shown(diff, authenticated)}"))
    if request.num_nodes != session.num_nodes and idle and session.started_any():
        # every member of the old run went away after training: an elastic restart whose node
        # count changed without a new incarnation (torchrun does not count membership changes)
        return Restart(f"job restarted with {request.num_nodes} nodes instead of {session.num_nodes}")
    if request.num_nodes != session.num_nodes:
        return Refuse(Conflict(f"node {node} says num_nodes={request.num_nodes}, the session has "
                               f"{session.num_nodes}"))
    if (request.quorum, request.grace_ms) != session.quorum_settings:
        return Refuse(Conflict(f"node {node} says CGX_PS_QUORUM={request.quorum} CGX_PS_GRACE_MS={request.grace_ms}, "
                               f"the session has CGX_PS_QUORUM={session.quorum_settings[0]} "
                               f"CGX_PS_GRACE_MS={session.quorum_settings[1]}: every node must set the same"))
    if len(session.nodes) >= session.num_nodes:
        return Refuse(Conflict(f"node {node} would be node {len(session.nodes) + 1} of a session of "
                               f"{session.num_nodes} nodes: {sorted(session.nodes)}"))
    return Join()


def _may_join(session: Session, request: ps_pb2.RegisterRequest) -> bool:
    """Can this fresh process be a member of the session's start of the job (rather than of a newer one)?"""
    node, member = request.node_id, request.member
    if member in session.nodes.get(node, ()):
        return not session.started(node, member)  # its slot's process trained: that start is over
    fits = request.num_nodes == session.num_nodes and first_difference(session.layout, request.layout) is None
    return fits and (node in session.nodes or len(session.nodes) < session.num_nodes)


def session_incarnation(previous: Session | None, request: ps_pb2.RegisterRequest) -> int:
    """The incarnation of the session ``request`` starts (after ``previous``, if any): above the
    previous one of the same job, so its members and any process of that earlier start differ."""
    if previous is None or previous.job_id != request.job_id:
        return request.incarnation
    return max(request.incarnation, previous.incarnation + 1)


def check_registration(request: ps_pb2.RegisterRequest, config: ServerConfig) -> str:
    """The layout hash of a well-formed Register this shard can serve; raises why not."""
    node = request.node_id
    if not node:
        raise BadRequest("node_id is empty")
    if len(node) > MAX_ID_CHARS or len(request.job_id) > MAX_ID_CHARS:
        raise BadRequest(f"node_id ({len(node)} chars) and job_id ({len(request.job_id)} chars) must "
                         f"be at most {MAX_ID_CHARS} characters")
    if request.num_nodes < 1:
        raise BadRequest("num_nodes must be >= 1")
    problem = quorum_problem(request.quorum, request.grace_ms, request.num_nodes)
    if problem is not None:
        raise BadRequest(f"node {node}: {problem}")
    try:
        validate_layout(request.layout)
    except LayoutError as exc:
        raise BadRequest(f"bad layout from {node}: {exc}") from None
    digest = layout_hash(request.layout)
    if digest != request.layout_hash:
        raise BadRequest(f"layout_hash {request.layout_hash[:12]}… does not match the layout "
                         f"sent ({digest[:12]}…): client and server disagree on hashing")
    if request.layout.num_shards != config.num_shards:
        raise Conflict(f"layout is sharded for {request.layout.num_shards} shards, this shard "
                       f"was started with --num-shards {config.num_shards}")
    _check_memory(request.layout, config)
    return digest


def _check_memory(layout: ps_pb2.Layout, config: ServerConfig) -> None:
    """Raise if this shard cannot hold a layout's blocks within its memory limits."""
    owned = owned_blocks(layout, config.shard_index)
    largest = max((HEADER_SIZE + 4 * b.numel for b in owned), default=0)
    if largest > config.max_inflight_bytes:
        raise BadRequest(f"a block of {largest} bytes (fp32) exceeds this shard's in-flight budget of "
                         f"{config.max_inflight_bytes} bytes (--max-inflight-mb): use smaller blocks")
    state = 4 * sum(b.numel for b in owned) * (2 if config.error_feedback else 1)
    if state > config.max_model_bytes:
        raise BadRequest(f"the layout needs {state} bytes of fp32 state on this shard, more than its "
                         f"--max-model-mb of {config.max_model_bytes} bytes: use more shards")
