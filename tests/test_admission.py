"""Session admission as a pure decision: every outcome of ``admit``, and the checks before it.

No server, no network: a Session is built from a RegisterRequest and admission reads its state.
"""

from __future__ import annotations

import pytest

from cgx_ps.model_layout import layout_hash
from cgx_ps.server.session.admission import Join, Refuse, Restart, admit, check_registration, session_incarnation
from cgx_ps.server.rounds.aggregator import RoundFailure
from cgx_ps.server.session.blobs import BlobStore
from cgx_ps.server.config import ServerConfig
from cgx_ps.server.errors import BadRequest, Busy, Conflict, WITHHELD
from cgx_ps.server.session.job_session import Session
from cgx_ps.v1 import ps_pb2
from cgx_ps.worker.pipeline.blocks import Compression, TensorInfo, build_layout

CONFIG = ServerConfig(round_timeout_s=5.0)
LAYOUT = build_layout([TensorInfo("secret.w", (64, 64))], 1, Compression(bits=None))
OTHER = build_layout([TensorInfo("secret.w", (64, 65))], 1, Compression(bits=None))


def register(node: str = "node-0", member: int = 0, nodes: int = 2, job: str = "J",
             layout: ps_pb2.Layout = LAYOUT, incarnation: int = 0, resume: bool = False) -> ps_pb2.RegisterRequest:
    return ps_pb2.RegisterRequest(node_id=node, member=member, num_nodes=nodes, job_id=job, layout=layout,
                                  layout_hash=layout_hash(layout), incarnation=incarnation, resume=resume)


def session_of(first: ps_pb2.RegisterRequest, *more: tuple[str, int]) -> Session:
    """A session started by ``first``, with ``more`` (node, member) pairs joined."""
    session = Session(first, layout_hash(first.layout), CONFIG, None, BlobStore(1 << 20))
    for node, member in [(first.node_id, first.member), *more]:
        session.join(node, member)
    return session


def decide(session: Session | None, request: ps_pb2.RegisterRequest, in_flight: int = 0, idle_s: float = 0.0,
           authenticated: bool = True):
    now = (session.last_activity if session is not None else 0.0) + idle_s
    return admit(session, request, in_flight=in_flight, now=now, authenticated=authenticated)


# ---- Join ----------------------------------------------------------------------------------------


def test_a_new_node_joins_while_there_is_room() -> None:
    assert decide(session_of(register("node-0")), register("node-1")) == Join()


def test_another_member_of_a_known_node_joins() -> None:
    assert decide(session_of(register("node-0")), register("node-0", member=1)) == Join()


def test_a_retried_register_joins_again() -> None:
    session = session_of(register("node-0"))
    assert decide(session, register("node-0")) == Join()  # its first reply was lost: idempotent


# ---- Restart ---------------------------------------------------------------------------------------


def test_the_first_register_starts_a_session() -> None:
    assert isinstance(decide(None, register()), Restart)


def test_a_failed_session_is_replaced() -> None:
    session = session_of(register())
    session.aggregator.failed = RoundFailure(0, 3, "round 3 timed out", ("node-1",))
    assert decide(session, register()) == Restart("session reset after failure")


def test_another_job_replaces_an_idle_session() -> None:
    assert decide(session_of(register(job="A")), register(job="B")) == \
        Restart("job 'B' replaces finished job 'A'")


@pytest.mark.parametrize("how", ["streamed", "other layout"])
def test_a_member_that_registers_again_after_starting_restarts_the_job(how: str) -> None:
    session = session_of(register("node-0"), ("node-1", 0))
    if how == "streamed":
        session.open_stream("node-0", 0)  # it began training, so this Register is a restarted process
        again = register("node-0")
    else:
        again = register("node-0", layout=OTHER)
    assert decide(session, again) == Restart("session reset: node node-0 member 0 registered again")


def test_a_job_without_id_replaces_a_session_idle_for_ten_seconds() -> None:
    session = session_of(register(job=""))
    assert decide(session, register("node-1", job="", layout=OTHER), idle_s=11) == \
        Restart("a new job (no job id) replaces an idle session")
    assert isinstance(decide(session, register("node-1", job="", layout=OTHER), idle_s=5), Refuse)


# ---- Refuse ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("busy", ["stream open", "rounds in flight"])
@pytest.mark.parametrize("authenticated", [True, False])
def test_another_job_waits_while_the_shard_is_busy(busy: str, authenticated: bool) -> None:
    session = session_of(register(job="job-secret-42"))
    if busy == "stream open":
        session.open_stream("node-0", 0)
    outcome = decide(session, register(job="other"), in_flight=1 if busy == "rounds in flight" else 0,
                     authenticated=authenticated)
    assert isinstance(outcome, Refuse) and isinstance(outcome.error, Busy)  # retryable: UNAVAILABLE
    assert "busy with another job" in outcome.error.message
    assert ("job-secret-42" in outcome.error.message) == authenticated  # strangers do not learn it


@pytest.mark.parametrize("authenticated", [True, False])
def test_a_different_layout_is_refused_naming_the_difference_to_members_only(authenticated: bool) -> None:
    outcome = decide(session_of(register("node-0")), register("node-1", layout=OTHER), authenticated=authenticated)
    assert isinstance(outcome, Refuse) and isinstance(outcome.error, Conflict)
    assert "different model layout" in outcome.error.message
    assert ("secret.w" in outcome.error.message) == authenticated
    assert (WITHHELD in outcome.error.message) != authenticated


def test_a_node_count_that_disagrees_is_refused() -> None:
    outcome = decide(session_of(register("node-0", nodes=2)), register("node-1", nodes=3))
    assert isinstance(outcome, Refuse) and isinstance(outcome.error, Conflict)
    assert "num_nodes=3, the session has 2" in outcome.error.message


def test_a_node_beyond_the_session_size_is_refused() -> None:
    outcome = decide(session_of(register("node-0"), ("node-1", 0)), register("node-2"))
    assert isinstance(outcome, Refuse) and isinstance(outcome.error, Conflict)
    assert "would be node 3 of a session of 2 nodes" in outcome.error.message


# ---- restarts of the job: incarnations, another node count (issue 15) -----------------------------


@pytest.mark.parametrize("nodes", [2, 3])
def test_a_new_incarnation_restarts_the_session_at_once(nodes: int) -> None:
    session = session_of(register("node-0"), ("node-1", 0))
    session.open_stream("node-1", 0)  # even while a member of the old start still has a stream
    outcome = decide(session, register("node-1", nodes=nodes, incarnation=1), in_flight=3)
    assert outcome == Restart("job restarted: incarnation 1 replaces 0")


def test_a_process_of_an_earlier_incarnation_rejoining_is_refused() -> None:
    """A recovering process presents the incarnation the shard gave it: a lower one than the
    session's is left over from an earlier start."""
    session = session_of(register("node-0", incarnation=2))
    outcome = decide(session, register("node-1", incarnation=1, resume=True))
    assert isinstance(outcome, Refuse) and isinstance(outcome.error, Conflict)
    assert "incarnation 1 of the job, the shard serves its incarnation 2" in outcome.error.message
    # a restarted shard lost its count: a left-over process that rejoined it first is replaced
    assert isinstance(decide(session_of(register("node-0", incarnation=1, resume=True)),
                             register("node-1", incarnation=2, resume=True)), Restart)


@pytest.mark.parametrize("count", [0, 5])
def test_a_fresh_process_joins_whatever_its_launcher_counted(count: int) -> None:
    """torchrun counts restarts per node and a replaced pod counts from 0: a fresh process's
    count lower (or higher) than the session's does not keep it out of its start of the job."""
    session = session_of(register("node-0", incarnation=2))
    assert decide(session, register("node-1", incarnation=count)) == Join()


def test_a_fresh_lower_count_whose_slot_trained_restarts_the_job() -> None:
    """A replaced node registering before its peers: its slot's old process trained, so the job
    restarted, and the new session counts above the old one, whatever the node's count."""
    session = session_of(register("node-0", incarnation=3), ("node-1", 0))
    session.open_stream("node-1", 0)
    request = register("node-1", incarnation=0)
    assert decide(session, request) == Restart("session reset: node node-1 member 0 registered again")
    assert session_incarnation(session, request) == 4
    assert session_incarnation(session, register("node-0", incarnation=7)) == 7  # a higher count stands
    assert session_incarnation(None, request) == 0 and session_incarnation(session, register(job="K")) == 0


def test_another_node_count_restarts_a_session_only_once_its_run_went_away() -> None:
    session = session_of(register("node-0"), ("node-1", 0))
    session.open_stream("node-0", 0)
    grown = register("node-2", nodes=3)
    assert isinstance(decide(session, grown), Refuse)  # its old members still train
    session.close_stream(session.streams[("node-0", 0)])  # they are gone (torchrun stopped them)
    assert decide(session, grown) == Restart("job restarted with 3 nodes instead of 2")


# ---- the checks before admission -----------------------------------------------------------------


@pytest.mark.parametrize("change, error, match", [
    (dict(node_id=""), BadRequest, "node_id is empty"),
    (dict(job_id="j" * 257), BadRequest, "at most 256 characters"),
    (dict(num_nodes=0), BadRequest, "num_nodes must be >= 1"),
    (dict(layout_hash="nope"), BadRequest, "does not match the layout"),
])
def test_malformed_registers_are_refused(change: dict, error: type, match: str) -> None:
    request = register()
    for field, value in change.items():
        setattr(request, field, value)
    with pytest.raises(error, match=match):
        check_registration(request, CONFIG)


def test_registers_this_shard_cannot_serve_are_refused() -> None:
    assert check_registration(register(), CONFIG) == layout_hash(LAYOUT)
    with pytest.raises(Conflict, match="sharded for 1 shards, this shard was started with --num-shards 2"):
        check_registration(register(), ServerConfig(num_shards=2))
    with pytest.raises(BadRequest, match="more than its --max-model-mb"):
        check_registration(register(), ServerConfig(max_model_bytes=1000))
