"""cert-manager Certificates in a render, and gRPC's check of a server name against a
certificate's dnsNames."""

from __future__ import annotations

from .manifests import objects


def grpc_name_matches(name: str, dns_names: list[str]) -> bool:
    """gRPC's check of a server name against a certificate's dnsNames: exact (any case), or
    a "*." wildcard for the first label only, with at least two labels after it ("*.svc"
    style wildcards are rejected, see test_wait_for_shards_speaks_mtls_like_the_workers)."""
    name = name.lower().rstrip(".")
    for pattern in (d.lower().rstrip(".") for d in dns_names):
        if pattern == name:
            return True
        if pattern.startswith("*.") and "." in pattern[2:] and "." in name:
            if name.split(".", 1)[1] == pattern[2:]:
                return True
    return False


def certificates(rel: str) -> dict[str, dict]:
    """cert-manager Certificates by the Secret they write."""
    return {c["spec"]["secretName"]: c for c in objects(rel, "Certificate")}
