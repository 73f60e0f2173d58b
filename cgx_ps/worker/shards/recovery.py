"""What a worker does when its connection to a shard breaks: the decisions, as pure functions.

``ShardClient``'s supervisor (supervisor.py) and its exchange stream (exchange_stream.py) carry
them out. They read a status as the name of a ``grpc.StatusCode``: a control call's, or the
``StreamEnded`` of an Exchange stream on either data plane (exchange_call.py). The decisions, in the order they
come up:

0. Connecting or reconnecting fails: ``connect_failure`` says whether to try again (the shard
   is not there yet) or give up (a refused token, a failed TLS handshake, another refusal). A
   connection the shard closed before HTTP/2 (``closed_while_connecting``) is probed once
   (shards/tls_probe.py): it may be a TLS mismatch gRPC cannot name.

1. A stream ended: ``after_stream_end`` says whether it may be recovered (the shard went away,
   restarted, or the connection dropped) or ends the job (a round failed for everyone, a
   refusal: retrying cannot help).
2. While recovering, each attempt asks the shard for its instance id (Status) and
   ``reconnect_action`` says how to go on: the same instance kept the session, so ``Reopen`` a
   stream in it and push again what was not answered (the shard's duplicate handling makes
   that idempotent); another instance lost it, so ``Rejoin``: register again as a resuming
   node, restore the last results it gave us and push again what was not answered.
3. Attempts are spaced by ``Backoff`` (jittered, so the nodes of a job do not retry in step) and
   bounded by the recovery timeout (``CGX_PS_RECOVERY_TIMEOUT``).
4. A shard that keeps the connection but answers nothing (stopped, hung) is caught by
   ``hung_after_s``: a push unanswered that long is overdue (a shard promises a result or a
   RoundError within its round timeout of the round's first push). An overdue shard that still
   answers a Status call within ``LIVENESS_TIMEOUT_S`` is alive, only slow (a shard's first
   rounds compile its kernels); ``is_hung`` gives it up to ``SLOW_LIMIT`` x that long.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..errors import CgxPsError, ShardRejectedError

__all__ = ["Backoff", "Fail", "HUNG_GRACE_S", "LIVENESS_TIMEOUT_S", "Recover", "Rejoin", "Reopen", "SLOW_LIMIT",
           "WRITE_FAILED_DETAILS", "after_stream_end", "broke_under_write", "closed_while_connecting",
           "connect_failure", "hung_after_s", "is_hung", "reconnect_action"]

# Beyond the round timeout, what a round's result may take: summing, re-encoding and sending it
# back. With the liveness check below, a stopped shard is reported within the round timeout +
# HUNG_GRACE_S + LIVENESS_TIMEOUT_S + one supervisor tick (0.5 s): under 10 s past its round timeout.
HUNG_GRACE_S = 5.0
LIVENESS_TIMEOUT_S = 2.0
SLOW_LIMIT = 3.0

_RETRYABLE = {"UNAVAILABLE", "DEADLINE_EXCEEDED"}
# The status grpc.aio gives a call when one of our writes fails because the connection broke under
# it (the shard died, the connection was reset): the write's failure replaces the transport's
# UNAVAILABLE (grpc/grpc#34148, #36066), and the stream's reader sees this INTERNAL instead. It is
# the client's own marker, never a shard's: a shard's INTERNAL says "shard error ...". Measured
# here: a shard SIGKILLed during a write ends the stream with it in 11 of 20 trials; taking it for
# a refusal failed a worker instead of recovering (the 1-in-12 chaos-test flake of issue 15).
WRITE_FAILED_DETAILS = "Internal error from Core"
# Words gRPC puts in the details of a failed TLS handshake ("Ssl handshake failed: SSL_ERROR_SSL:
# ... CERTIFICATE_VERIFY_FAILED"): retrying will not fix a certificate. gRPC's own words only:
# a bare "tls" would also match a host name such as mtls-shard-0 in a name-lookup failure.
_TLS_FAILURE_MARKERS = ("handshake failed", "certificate_verify_failed", "ssl_error")
# gRPC's words when the shard's certificate does not name the host we asked for (the address, or
# CGX_PS_TLS_SERVER_NAME), and when our own key cannot be used (it does not match our certificate).
_WRONG_NAME_MARKER = "hostname verification check failed"
_BAD_CLIENT_KEY_MARKER = "failed to create security handshaker"
# gRPC's words when the shard closed the connection before HTTP/2 began: a TLS mismatch, or a shard
# going away mid-connect; shards/tls_probe.py tells them apart.
_CLOSED_MARKER = "socket closed"


def connect_failure(address: str, code: str, details: str, tls: bool = False) -> CgxPsError | None:
    """The error that ends connecting to a shard, or None when the failure may pass (retry);
    ``code``: a grpc.StatusCode's name; ``tls``: the channel uses TLS (only then can a failure be
    a handshake's)."""
    if code == "UNAUTHENTICATED":
        return ShardRejectedError(address, code, f"{details} (check CGX_PS_TOKEN_FILE: the shards and "
                                                      f"workers of a job must use the same token)")
    lowered = details.lower()
    if tls and code == "UNAVAILABLE" and _WRONG_NAME_MARKER in lowered:
        return ShardRejectedError(address, "TLS", f"the shard's certificate does not name the host this worker "
                                                  f"dials: {details} (check CGX_PS_TLS_SERVER_NAME, or unset it to "
                                                  f"check the host of CGX_PS_SERVERS)")
    if tls and code == "UNAVAILABLE" and _BAD_CLIENT_KEY_MARKER in lowered:
        return ShardRejectedError(address, "TLS", f"this worker's TLS client credentials cannot be used: {details} "
                                                  f"(check that CGX_PS_TLS_KEY is the key of CGX_PS_TLS_CERT)")
    if tls and code == "UNAVAILABLE" and any(m in lowered for m in _TLS_FAILURE_MARKERS):
        return ShardRejectedError(address, "TLS", f"the TLS handshake failed: {details} (check CGX_PS_TLS_CA, "
                                                  f"CGX_PS_TLS_CERT/KEY and CGX_PS_TLS_SERVER_NAME)")
    if code not in _RETRYABLE and not broke_under_write(code, details):
        return ShardRejectedError(address, code, details)
    return None


def closed_while_connecting(code: str, details: str) -> bool:
    """Did the shard close the connection before HTTP/2 began (worth a TLS probe, shards/tls_probe.py)?"""
    return code == "UNAVAILABLE" and details.lower().endswith(_CLOSED_MARKER)


def broke_under_write(code: str | None, details: str) -> bool:
    """Did a call end because the connection broke while we wrote to it (not by the shard's word)?"""
    return code == "INTERNAL" and details == WRITE_FAILED_DETAILS


@dataclass(frozen=True)
class Recover:
    cause: str


@dataclass(frozen=True)
class Fail:
    code: str  # a grpc.StatusCode's name
    details: str


def after_stream_end(code: str | None, details: str, closing: bool) -> Recover | Fail | None:
    """What a stream's end means. ``code``: its StreamEnded's, None when it ended without an
    error (the shard's clean end); ``closing``: we are closing it ourselves (then None: nothing to do)."""
    if closing:
        return None
    if code is None:
        return Recover("the shard closed the stream")
    if code in ("UNAVAILABLE", "CANCELLED"):
        # UNAVAILABLE: the shard died, drains for a restart, or the connection dropped. CANCELLED
        # without our asking: the transport gave up on the call (a reset connection).
        return Recover(f"{code}: {details}")
    if broke_under_write(code, details):
        return Recover(f"the connection broke while pushing ({code}: {details})")
    return Fail(code, details)  # ABORTED (a failed round, a reset session) and refusals are final


@dataclass(frozen=True)
class Reopen:
    """The shard instance we registered with is still there: its session and rounds go on."""


@dataclass(frozen=True)
class Rejoin:
    """Another instance serves the address (the shard restarted): our session is gone."""


def reconnect_action(registered_instance: str, serving_instance: str) -> Reopen | Rejoin:
    return Reopen() if serving_instance == registered_instance else Rejoin()


class Backoff:
    """Exponential delays with jitter: ``first`` doubling up to ``cap``, each drawn from
    [0.5, 1.5) x the nominal delay. The cap is small on purpose: a shard restarted on the same
    address is typically back within seconds, and resuming must not wait long after it is."""

    def __init__(self, first: float = 0.05, cap: float = 0.5, rng: random.Random | None = None) -> None:
        self.nominal, self.cap = first, cap
        self._rng = rng or random.Random()

    def next(self) -> float:
        delay = self.nominal * (0.5 + self._rng.random())
        self.nominal = min(self.nominal * 2, self.cap)
        return delay


def hung_after_s(round_timeout_s: float) -> float:
    """How long a push may go unanswered on a healthy connection before the shard counts as hung."""
    return round_timeout_s + HUNG_GRACE_S


def is_hung(waited_s: float, round_timeout_s: float, answers_status: bool) -> bool:
    """An overdue push (``waited_s`` > ``hung_after_s``): is its shard hung, or only slow?"""
    return not answers_status or waited_s > SLOW_LIMIT * hung_after_s(round_timeout_s)
