"""Server TLS whose certificate files can change under a running shard.

gRPC asks ``fetch`` at every new connection's handshake; it returns new settings only when the
files changed (modification time or size) or SIGHUP asked for a reload, so cert-manager
renewing a mounted Secret needs no restart. Existing connections keep the certificate they
were opened with. A reload that fails (a half-written file) keeps the last good certificate and
says so once per change.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading

import grpc

from ...net.security import CredentialError, read_pem

__all__ = ["ReloadingServerCredentials", "check_key_matches"]

log = logging.getLogger(__name__)


def check_key_matches(cert_file: str, key_file: str) -> None:
    """CredentialError unless ``key_file`` is the private key of ``cert_file``'s certificate. gRPC
    would refuse the pair only when it binds, as "cannot bind" (a port problem), and refuses a
    renewed pair half-written (new certificate, old key) at every handshake."""
    try:
        # the password makes an encrypted key fail here instead of prompting on the terminal
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file, password=b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise CredentialError(f"TLS key file (--tls-key) {key_file!r} is not the private key of the certificate "
                                  f"in --tls-cert {cert_file!r}") from None
        raise CredentialError(f"TLS certificate (--tls-cert) {cert_file!r} and key (--tls-key) {key_file!r} cannot "
                              f"be loaded: {exc.reason or exc}") from None


class ReloadingServerCredentials:
    def __init__(self, cert_file: str, key_file: str, client_ca_file: str | None = None) -> None:
        self.files = [f for f in (cert_file, key_file, client_ca_file) if f]
        self.cert_file, self.key_file, self.client_ca_file = cert_file, key_file, client_ca_file
        self._lock = threading.Lock()  # gRPC may call fetch from its own threads
        self._force = False
        self.reloads = 0
        self._stamp = self._stamps()
        self._initial = self._config()  # raises CredentialError naming a bad file: fail at start
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._initial, self.fetch, require_client_authentication=client_ca_file is not None)

    def _stamps(self) -> tuple[tuple[float, int], ...]:
        out = []
        for f in self.files:
            try:
                st = os.stat(f)
                out.append((st.st_mtime, st.st_size))
            except OSError:
                out.append((-1.0, -1))
        return tuple(out)

    def _config(self):
        cert = read_pem(self.cert_file, "TLS certificate file (--tls-cert)")
        key = read_pem(self.key_file, "TLS key file (--tls-key)")
        ca = read_pem(self.client_ca_file, "client CA file (--tls-client-ca)") if self.client_ca_file else None
        check_key_matches(self.cert_file, self.key_file)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def request_reload(self) -> None:
        """Re-read the files at the next handshake even if they look unchanged (SIGHUP)."""
        self._force = True

    def fetch(self):
        """gRPC's certificate fetcher: new settings, or None for "unchanged"."""
        with self._lock:
            stamp = self._stamps()
            if stamp == self._stamp and not self._force:
                return None
            self._force = False
            self._stamp = stamp
            try:
                config = self._config()
            except CredentialError as exc:
                log.warning("TLS reload failed, keeping the previous certificate: %s", exc)
                return None
            self.reloads += 1
            log.info("TLS certificate files reloaded (%s)", ", ".join(self.files))
            return config
