"""Cases and their plans: which method, caller and style each case is, the Plan it sends, and
the metadata each kind of caller carries."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from google.protobuf.message import Message

from cgx_ps.v1 import ps_pb2

from .messages import fill_message
from .mutations import garbage, mutate_sequence
from .scenarios import SCENARIOS
from .scenarios.exchange import exchange_valid_push
from .scenarios.getblob import getblob_existing
from .scenarios.probe import probe_valid
from .scenarios.putblob import putblob_valid
from .scenarios.register import register_valid
from .scenarios.setcodecs import setcodecs_valid
from .settings import CALL_DEADLINE_S, CLIENT_STREAMS, KINDS, METHODS, REQUEST_TYPES, STYLE_WEIGHTS, STYLES
from .world import Identity, Plan, World

@dataclass(frozen=True)
class Case:
    index: int
    method: str
    kind: str
    style: str
    scenario: str = ""  # for the sequence style: which one (the corpus names it, else random)


def make_cases(count: int, seed: int) -> list[Case]:
    """First the corpus, every scenario once from a member and once from a stranger, then cases
    that go round the methods and kinds (so every pair gets its share) with a random style."""
    corpus = [(m, kind, fn.__name__) for m in METHODS for kind in ("member", "stranger") for fn in SCENARIOS[m]]
    cases = [Case(i, m, kind, "sequence", name) for i, (m, kind, name) in enumerate(corpus[:count])]
    for i in range(len(cases), count):
        rng = case_rng(seed, i, "style")
        cases.append(Case(i, METHODS[i % len(METHODS)], KINDS[(i // len(METHODS)) % len(KINDS)],
                          rng.choices(STYLES, STYLE_WEIGHTS)[0]))
    return cases


def case_rng(seed: int, index: int, purpose: str = "") -> random.Random:
    return random.Random(f"{seed}:{index}:{purpose}")  # str seeds hash deterministically (sha512)


def plan_for(case: Case, rng: random.Random, w: World, who: Identity) -> Plan:
    if case.style == "sequence":
        scenarios = SCENARIOS[case.method]
        fn = next((s for s in scenarios if s.__name__ == case.scenario), None) or rng.choice(scenarios)
        plan = fn(rng, w, who)
        plan.scenario = fn.__name__
        return plan
    if case.style == "mutated":
        base = valid_plan(case.method, rng, w, who)
        return Plan(mutate_sequence(rng, base.messages), deadline=CALL_DEADLINE_S)
    count = rng.randint(0, 4) if case.method in CLIENT_STREAMS else 1
    if case.style == "garbage":
        return Plan([garbage(rng) for _ in range(count)])
    return Plan(generated_stream(case.method, rng, w, who, count))


def valid_plan(method: str, rng: random.Random, w: World, who: Identity) -> Plan:
    """A valid call of ``method`` (for this caller), the base that mutations start from."""
    valid = {"Register": register_valid, "Exchange": exchange_valid_push, "PutBlob": putblob_valid,
             "GetBlob": getblob_existing, "SetCodecs": setcodecs_valid, "Probe": probe_valid}[method]
    return valid(rng, w, who)


def generated_stream(method: str, rng: random.Random, w: World, who: Identity, count: int) -> list[bytes]:
    """Generated messages; a member's carry its identity half the time, so they get past the
    membership checks to the field checks behind them."""
    messages = []
    for i in range(count):
        message = fill_message(rng, REQUEST_TYPES[method]())
        if rng.random() < 0.5:
            wear_identity(message, who, w)
        if method == "Exchange" and i == 0 and rng.random() < 0.5:
            message = ps_pb2.ExchangeRequest(hello=ps_pb2.Hello(node_id=who.node, layout_hash=w.layout_hash,
                                                                member=who.member, session_id=who.session_id))
        messages.append(message.SerializeToString())
    return messages


def wear_identity(message: Message, who: Identity, w: World) -> None:
    """Make a generated message claim the caller's identity, in the fields it has of these."""
    fields = message.DESCRIPTOR.fields_by_name
    target = message.hello if "hello" in fields and message.WhichOneof("kind") == "hello" else message
    names = target.DESCRIPTOR.fields_by_name
    for name, value in (("node_id", who.node), ("member", who.member), ("session_id", who.session_id),
                        ("layout_hash", w.layout_hash)):
        if name in names:
            setattr(target, name, value)


def metadata_for(kind: str, rng: random.Random, token: str) -> tuple[tuple[str, str], ...]:
    if kind == "no-token":
        return rng.choice(((), (("x-fuzz", "1"),)))
    if kind == "wrong-token":
        wrong = "".join(rng.choices(string.ascii_letters + string.digits + "-_", k=len(token)))
        value = rng.choice([f"Bearer {wrong}", "Bearer", "Bearer ", token, f"Basic {token}", f"Bearer {token[:-1]}",
                            f"Bearer {token}x", f"Bearer {token[:-1]}{chr(ord(token[-1]) ^ 1)}",
                            "Bearer " + "A" * rng.randrange(1000, 7000)])
        return (("authorization", value),)
    return (("authorization", f"Bearer {token}"),)
