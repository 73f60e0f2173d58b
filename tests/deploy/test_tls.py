"""Security: TLS (deploy/optional/tls, cert-manager): the cert-manager objects field by field,
the TLS files mounted read-only, plaintext probes on a health-only port, and certificate names
that cover every shard address."""

from __future__ import annotations

import re

import pytest

from cgx_ps.net.addresses import servers_from_env
from cgx_ps.net.security import ChannelSecurity

from .certificates import certificates, grpc_name_matches
from .kubelet import container_env, readable_only_by_the_pod_user, secret_file
from .manifests import (DOWNWARD, TLS_DIRS, all_containers, config, container, is_custom_resource, objects, one,
                        pod_spec, render, shard_sts, worker_job, workloads)
from .netpol import admits, peers, shard_ports


def go_duration_hours(text: str) -> float:
    units = {"h": 1.0, "m": 1 / 60, "s": 1 / 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text}"
    return sum(float(n) * units[u] for n, u in parts)


CERT_SPEC_FIELDS = {"secretName", "commonName", "dnsNames", "uris", "ipAddresses", "emailAddresses",
                    "usages", "duration", "renewBefore", "privateKey", "issuerRef", "isCA", "subject",
                    "secretTemplate", "revisionHistoryLimit", "keystores", "literalSubject",
                    "encodeUsagesInRequest", "additionalOutputFormats", "nameConstraints", "otherNames"}
KEY_USAGES = {"signing", "digital signature", "content commitment", "key encipherment", "key agreement",
              "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
              "server auth", "client auth", "code signing", "email protection", "s/mime",
              "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
              "microsoft sgc", "netscape sgc"}


@pytest.mark.parametrize("rel", TLS_DIRS)
def test_cert_manager_objects(rel):
    """No schema for cert-manager in kubernetes-validate: its fields, checked by hand."""
    custom = [o for o in render(rel) if is_custom_resource(o)]
    assert {(o["apiVersion"], o["kind"]) for o in custom} == {("cert-manager.io/v1", "Issuer"),
                                                            ("cert-manager.io/v1", "Certificate")}
    issuers = {o["metadata"]["name"]: o for o in objects(rel, "Issuer")}
    certs = certificates(rel)
    ca_certs = {name: c for name, c in certs.items() if c["spec"].get("isCA")}
    for issuer in issuers.values():
        assert set(issuer) == {"apiVersion", "kind", "metadata", "spec"}
        (kind, body), = issuer["spec"].items()
        assert kind in ("selfSigned", "ca"), kind
        if kind == "ca":
            assert set(body) == {"secretName"} and body["secretName"] in ca_certs
    for secret_name, cert in certs.items():
        spec = cert["spec"]
        assert set(spec) <= CERT_SPEC_FIELDS, set(spec) - CERT_SPEC_FIELDS
        assert spec.get("commonName") or spec.get("dnsNames")
        assert set(spec.get("usages", [])) <= KEY_USAGES
        assert set(spec["privateKey"]) <= {"algorithm", "size", "rotationPolicy", "encoding"}
        assert spec["privateKey"]["rotationPolicy"] in ("Never", "Always")
        ref = spec["issuerRef"]
        assert ref.get("kind") == "Issuer" and ref.get("group", "cert-manager.io") == "cert-manager.io"
        issuer = issuers[ref["name"]]["spec"]
        # The CA is self-signed; everything else comes from the CA issuer.
        assert ("selfSigned" in issuer) is bool(spec.get("isCA")), secret_name
        assert go_duration_hours(spec.get("renewBefore", "0h")) < go_duration_hours(spec.get("duration", "2160h"))
    # What the pods mount: a server certificate for the shards, a client one for the workers.
    sts, job = shard_sts(rel), worker_job(rel)
    shard_secrets = {v["secret"]["secretName"] for v in pod_spec(sts)["volumes"] if "secret" in v} & set(certs)
    worker_secrets = {v["secret"]["secretName"] for v in pod_spec(job)["volumes"] if "secret" in v} & set(certs)
    assert len(shard_secrets) == len(worker_secrets) == 1
    assert "server auth" in certs[shard_secrets.pop()]["spec"]["usages"]
    assert "client auth" in certs[worker_secrets.pop()]["spec"]["usages"]
    assert not set(ca_certs) & {v["secret"]["secretName"] for w in workloads(rel)
                                for v in pod_spec(w)["volumes"] if "secret" in v}, "the CA key stays out of pods"


SHARD_TLS_FILES = {"CGX_PS_TLS_CERT": "tls.crt", "CGX_PS_TLS_KEY": "tls.key", "CGX_PS_TLS_CLIENT_CA": "ca.crt"}
WORKER_TLS_FILES = {"CGX_PS_TLS_CA": "ca.crt", "CGX_PS_TLS_CERT": "tls.crt", "CGX_PS_TLS_KEY": "tls.key"}


@pytest.mark.parametrize("rel", TLS_DIRS)
def test_tls_files_are_cert_manager_secrets_mounted_read_only(rel):
    certs = certificates(rel)
    sts, job = shard_sts(rel), worker_job(rel)
    # The init container checks health over the same TLS port, so it needs the client files too.
    checks = [(sts, container(sts, "shard"), "server auth", SHARD_TLS_FILES)]
    checks += [(job, c, "client auth", WORKER_TLS_FILES) for c in all_containers(job)]
    for owner, c, usage, files in checks:
        env = container_env(rel, c, DOWNWARD)
        for var, key in files.items():
            assert var in env, f"{c['name']}: no {var}"
            mount, vol, got_key = secret_file(owner, c, env[var])
            assert mount.get("readOnly") is True and got_key == key, (c["name"], var)
            assert usage in certs[vol["secret"]["secretName"]]["spec"]["usages"], (c["name"], var)
            assert readable_only_by_the_pod_user(owner, vol)
        if owner is job:
            ChannelSecurity.from_env(env)   # the workers' own checks of the combination


@pytest.mark.parametrize("rel", TLS_DIRS)
def test_tls_probes_use_the_plaintext_health_port(rel):
    cfg = config(rel)
    health = int(cfg["CGX_PS_HEALTH_PORT"])
    c = container(shard_sts(rel), "shard")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["health"] == health and health not in (ports["grpc"], ports["metrics"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == health, probe
    # Only the kubelet (node traffic) reaches it: no Service port, no NetworkPolicy rule.
    svc = one(rel, "Service", "cgx-ps-shard")
    assert "health" not in {p["name"] for p in svc["spec"]["ports"]}
    p = peers(rel)
    for name, peer in p.items():
        assert not admits(rel, "Ingress", p["shard"], peer, shard_ports(rel)["health"]), name


@pytest.mark.parametrize("rel", TLS_DIRS)
def test_certificate_names_cover_every_shard_address(rel):
    (server_cert,) = [c for c in objects(rel, "Certificate") if "server auth" in c["spec"].get("usages", [])]
    dns_names = server_cert["spec"]["dnsNames"]
    cfg = config(rel)
    job = worker_job(rel)
    checked = 0
    for c in all_containers(job):
        env = container_env(rel, c, DOWNWARD)
        addresses = servers_from_env(env)
        assert len(addresses) == int(cfg["CGX_PS_NUM_SHARDS"])
        for address in addresses:
            host = address.rsplit(":", 1)[0]
            name = env.get("CGX_PS_TLS_SERVER_NAME") or host   # what gRPC checks
            assert grpc_name_matches(name, dns_names), f"{c['name']}: {address} checked as {name}, not in {dns_names}"
            checked += 1
    assert checked
