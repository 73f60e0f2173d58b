"""Fuzz a real shard over every RPC with generated, mutated and garbage messages.

    .venv/bin/python -m tests.shard_fuzzer --cases 10000 [--seed 0] [--subprocess | --in-process]

from the repository root; tests/test_fuzz.py imports it as ``shard_fuzzer`` (pytest puts tests/
on sys.path).

Starts ``cgx-ps server`` in its own process (by default: its RSS and its log are then its own),
checks a legitimate 2-node round works (this also warms up the kernels, so the RSS baseline is
taken after them), then sends ``--cases`` calls, 16 at a time, spread evenly over the six
ParameterServer RPCs and four kinds of caller:

    no-token      no authorization metadata
    wrong-token   a missing, malformed or wrong bearer token
    stranger      the right token with no, a wrong or someone else's session id
    member        the right token and the session id of a fresh Register: the call is from a
                  member of the session, so its messages reach the service's own checks

A call's messages are one of four styles: ``generated`` from the request type's descriptor with
hostile field values (huge and negative numbers, NaN/inf, long and odd unicode strings, huge
repeated fields, several oneof members at once), ``mutated`` (bit flips, truncation, insertion,
duplication... of valid messages and of their order), ``garbage`` bytes, or a protocol
``sequence`` (pushes with wrong offsets, rounds or blocks, blob chunks out of order, streams
closed half-way, stalled or never sending; see the ``@scenario`` functions). Everything travels
as raw bytes (no serializer), so anything can be sent. Every call has a deadline of 2 s (3.5 s
for those that stall longer than the shard's own 2 s timeouts).

Afterwards it checks that the shard process is alive and SERVING, that a legitimate 2-node round
still works, that the shard's RSS stayed within a bound derived from its caps, that it logged at
most one WARNING-or-worse line per bad call and no traceback, that no call ended INTERNAL or
UNKNOWN and that no status was too large for the client to receive; exit status 1 if not.

Case ``i`` draws from its own ``random.Random(f"{seed}:{i}")``, so its messages are reproducible
(what they meet depends on the cases that ran before and beside it). The first cases are a fixed
corpus, every protocol scenario once, so even a short run covers all of them.

One module per job: ``settings`` (what it calls, the shard's caps), ``values`` (hostile field
values), ``messages`` (generated messages), ``mutations`` (of valid messages, and garbage),
``world`` (what the fuzzer knows of the shard), ``scenarios`` (protocol sequences, one module
per RPC), ``cases`` (each case's method, caller, style and plan), ``calls`` (sending a plan),
``shard`` (the shard under test and its watchers), ``shard_log``, ``report`` and ``run`` (the
run and its command line).
"""

from .report import FuzzReport
from .run import main, run_fuzz
from .scenarios import SCENARIOS
from .settings import DETAILS_LIMIT, KINDS, METHODS, STYLES
from .shard_log import LogStats
from .world import fuzz_layout

__all__ = ["FuzzReport", "LogStats", "run_fuzz", "main", "DETAILS_LIMIT", "KINDS", "METHODS", "SCENARIOS", "STYLES",
           "fuzz_layout"]
