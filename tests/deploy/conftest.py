"""Fixtures the deploy tests share: a throwaway PKI matching the TLS overlay's Certificates."""

from __future__ import annotations

import pytest


@pytest.fixture
def pki(tmp_path):
    """A throwaway CA (trustme), a shard certificate for the dnsNames of the rendered
    Certificate and a worker client certificate, as the files cert-manager's Secrets hold."""
    # imported here: without kubernetes-validate, importing manifests skips, and a conftest that
    # skips at import fails the whole collection instead of skipping the deploy tests
    from .manifests import objects

    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    (server_cert,) = [c for c in objects("overlays/cpu-local-tls", "Certificate")
                      if "server auth" in c["spec"].get("usages", [])]
    out = {}
    for who, cert in (("shard", ca.issue_cert(*server_cert["spec"]["dnsNames"])),
                      ("worker", ca.issue_cert("cgx-ps-worker"))):
        out[who] = {"tls.crt": cert.cert_chain_pems[0].bytes(), "tls.key": cert.private_key_pem.bytes(),
                    "ca.crt": ca.cert_pem.bytes()}
    return out
