"""Who may talk to a shard, and over what: the job token and the TLS material both ends share.

A job's shards and workers share one bearer token (a file, from a Kubernetes Secret or made by
``cgx-ps cluster`` / ``cgx-ps demo``). Every ParameterServer RPC carries it as gRPC metadata
``authorization: Bearer <token>``; the shard compares it in constant time before it parses a
byte of the request. TLS (optionally mutual) encrypts the channel and proves the shard's
identity; the token proves the caller belongs to the job, with or without TLS.

Nothing here talks to the network: it reads and checks files and builds gRPC credentials.
"""

from __future__ import annotations

import hmac
import os
import secrets
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc

from .channel_options import GRPC_OPTIONS

__all__ = ["AUTH_HEADER", "ChannelSecurity", "CredentialError", "MIN_TOKEN_CHARS", "bearer_matches",
           "check_key_pair", "new_token_file", "read_pem", "read_token"]

AUTH_HEADER = "authorization"  # gRPC metadata keys are lower case
MIN_TOKEN_CHARS = 16  # a guessable token is no token: refuse short ones at start
_MAX_FILE_BYTES = 1 << 20  # tokens and PEM bundles are small; a huge file is a mistake


class CredentialError(ValueError):
    """A token or certificate file is missing, unreadable or malformed; the message names it."""


def _read_small_file(path: str | os.PathLike, what: str) -> bytes:
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise CredentialError(f"{what} {str(p)!r}: cannot read it: {exc.strerror or exc}") from None
    if len(data) > _MAX_FILE_BYTES:
        raise CredentialError(f"{what} {str(p)!r} is larger than {_MAX_FILE_BYTES} bytes: not a {what}")
    return data


def read_token(path: str | os.PathLike) -> str:
    """The job token in a file (surrounding whitespace ignored); refuses an empty, short or
    non-printable one, naming the file."""
    raw = _read_small_file(path, "token file")
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CredentialError(f"token file {str(path)!r} is not ASCII text") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise CredentialError(f"token file {str(path)!r} holds {len(token)} characters; a job token needs at "
                              f"least {MIN_TOKEN_CHARS} (make one with: python -c 'import secrets; "
                              f"print(secrets.token_urlsafe(32))')")
    if not all(33 <= ord(c) < 127 for c in token):
        raise CredentialError(f"token file {str(path)!r}: the token must be printable ASCII without spaces")
    return token


def new_token_file(directory: str | os.PathLike) -> str:
    """Write a fresh random token into ``directory/token`` (mode 0600) and return the path."""
    path = Path(directory) / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return str(path)


def bearer_matches(metadata: Sequence[tuple[str, str | bytes]] | None, token: bytes) -> bool:
    """Does the call's metadata carry ``authorization: Bearer <token>``? Constant time in the
    token, so timing does not reveal how much of a guess was right."""
    presented = b""
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            raw = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
            presented = raw[7:] if raw[:7].lower() == b"bearer " else b""
            break
    return hmac.compare_digest(presented, token)


def check_key_pair(cert: str | os.PathLike, key: str | os.PathLike, cert_name: str, key_name: str) -> None:
    """CredentialError unless ``key`` is the private key of ``cert``: gRPC only says so in its own
    log and then fails every handshake ("Failed to create security handshaker")."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(str(cert), str(key))
    except ssl.SSLError as exc:
        raise CredentialError(f"{key_name} {str(key)!r} is not the key of {cert_name} {str(cert)!r} "
                              f"({exc.reason or exc})") from None


def read_pem(path: str | os.PathLike, what: str) -> bytes:
    """A PEM file's bytes, checked to hold at least one PEM block; errors name the file."""
    data = _read_small_file(path, what)
    if b"-----BEGIN " not in data:
        raise CredentialError(f"{what} {str(path)!r} holds no PEM block (-----BEGIN ...)")
    return data


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client reaches shards: the token file and TLS files (all optional).

    Files are read when a channel is opened, so a rotated client certificate is picked up by the
    next connection. ``server_name`` overrides the name checked in the shard's certificate (for
    shards addressed by IP)."""

    token_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise CredentialError("a client certificate needs both CGX_PS_TLS_CERT and CGX_PS_TLS_KEY")
        if self.tls_cert and not self.tls_ca:
            raise CredentialError("CGX_PS_TLS_CERT is set but CGX_PS_TLS_CA is not: a client certificate is only "
                                  "sent over TLS, and TLS needs the CA that signed the shards' certificates")

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca)

    def check(self) -> None:
        """Read every configured file once, so a typo fails at start and names the file."""
        self.metadata()
        self._credentials()
        if self.tls_cert and self.tls_key:
            check_key_pair(self.tls_cert, self.tls_key, "CGX_PS_TLS_CERT", "CGX_PS_TLS_KEY")

    def metadata(self) -> tuple[tuple[str, str], ...]:
        if not self.token_file:
            return ()
        return ((AUTH_HEADER, f"Bearer {read_token(self.token_file)}"),)

    def _credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls_ca:
            return None
        ca = read_pem(self.tls_ca, "TLS CA file (CGX_PS_TLS_CA)")
        key = read_pem(self.tls_key, "TLS key file (CGX_PS_TLS_KEY)") if self.tls_key else None
        cert = read_pem(self.tls_cert, "TLS certificate file (CGX_PS_TLS_CERT)") if self.tls_cert else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def aio_channel(self, address: str, options: Sequence[tuple[str, object]] = GRPC_OPTIONS) -> grpc.aio.Channel:
        credentials = self._credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=list(options))
        options = list(options)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.aio.secure_channel(address, credentials, options=options)

    def sync_channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        credentials = self._credentials()
        if credentials is None:
            return grpc.insecure_channel(address, options=list(options))
        options = list(options)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.secure_channel(address, credentials, options=options)

    @classmethod
    def from_env(cls, env: "os._Environ[str] | dict[str, str]") -> "ChannelSecurity":
        def get(name: str) -> str | None:
            return env.get(name, "").strip() or None

        return cls(token_file=get("CGX_PS_TOKEN_FILE"), tls_ca=get("CGX_PS_TLS_CA"), tls_cert=get("CGX_PS_TLS_CERT"),
                   tls_key=get("CGX_PS_TLS_KEY"), server_name=get("CGX_PS_TLS_SERVER_NAME"))
