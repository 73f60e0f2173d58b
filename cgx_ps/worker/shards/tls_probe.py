"""Why a shard closed the connection during the handshake: one TLS handshake of our own, to tell
a TLS mistake from a shard that is not up yet.

gRPC reports a plaintext worker dialing a TLS shard, and a TLS worker whose client certificate a
mutual-TLS shard refuses (none, or one from another CA), alike as "Socket closed" while
connecting, the words a shard that goes away mid-connect also gives. Retrying cannot fix either
mistake, so after the first such failure ``closed_connection_cause`` asks the shard with Python's
``ssl``: a shard that completes a TLS handshake with a plaintext worker's probe serves TLS; a
shard that completes one with our own settings and then closes the connection before its HTTP/2
SETTINGS (gRPC's TLS 1.3 server does so, without an alert, when it refuses the client's
certificate), or answers with a certificate alert (TLS 1.2), refused our certificate. Both are
certain and end the connect at once; anything else (no answer, a reset) stays a retry.
"""

from __future__ import annotations

import socket
import ssl

from ...net.security import ChannelSecurity

__all__ = ["PROBE_TIMEOUT_S", "closed_connection_cause"]

PROBE_TIMEOUT_S = 3.0
# A shard refusing our certificate in a TLS 1.2 handshake (or a TLS 1.3 server that sends an alert)
# answers with one of these.
_REFUSED_CERTIFICATE_ALERTS = ("CERTIFICATE_REQUIRED", "BAD_CERTIFICATE", "UNKNOWN_CA", "HANDSHAKE_FAILURE",
                               "CERTIFICATE_UNKNOWN", "ACCESS_DENIED")
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def closed_connection_cause(address: str, security: ChannelSecurity) -> str | None:
    """What the shard at ``address`` objects to in our TLS settings, or None when the probe finds
    nothing certain. Blocking (at most ~2 x PROBE_TIMEOUT_S): run it off the event loop."""
    if security.tls:
        refusal = _refusal_of_our_certificate(address, security)
        if refusal is None:
            return None
        if not security.tls_cert:
            return (f"the shard requires mutual TLS and this worker sends no client certificate ({refusal}): set "
                    f"CGX_PS_TLS_CERT and CGX_PS_TLS_KEY to a certificate signed by the CA the shard trusts "
                    f"(its --tls-client-ca)")
        return (f"the shard refused this worker's client certificate CGX_PS_TLS_CERT={security.tls_cert} "
                f"({refusal}): it must be signed by the CA the shard trusts (its --tls-client-ca)")
    if _speaks_tls(address):
        return ("the shard serves TLS and this worker connects in plaintext: set CGX_PS_TLS_CA to the CA "
                "that signed the shards' certificates (and CGX_PS_TLS_CERT/CGX_PS_TLS_KEY if the shard "
                "requires client certificates)")
    return None


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _speaks_tls(address: str) -> bool:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only asking whether it speaks TLS, not whom we reach
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection(_split(address), timeout=PROBE_TIMEOUT_S) as raw:
            with context.wrap_socket(raw, server_hostname=None):
                return True
    except (OSError, ValueError):  # ssl.SSLError is an OSError
        return False


def _refusal_of_our_certificate(address: str, security: ChannelSecurity) -> str | None:
    host, port = _split(address)
    context = ssl.create_default_context(cafile=security.tls_ca)
    if security.tls_cert and security.tls_key:
        context.load_cert_chain(security.tls_cert, security.tls_key)
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S) as raw:
            with context.wrap_socket(raw, server_hostname=security.server_name or host) as tls:
                tls.sendall(_H2_PREFACE)
                # TLS 1.3: the shard checks our certificate after the handshake; a shard that
                # accepts it sends its HTTP/2 SETTINGS, one that refuses it closes the connection
                if tls.recv(1) == b"":
                    return "it closed the connection after the TLS handshake, before speaking HTTP/2"
    except ssl.SSLError as exc:
        reason = exc.reason or ""
        return reason if any(alert in reason for alert in _REFUSED_CERTIFICATE_ALERTS) else None
    except (OSError, ValueError):
        return None
    return None
