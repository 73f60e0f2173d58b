"""Security: the NetworkPolicies admit exactly the intended traffic (the base, the optional
worker-egress and grafana components), and docs/deploy.md describes the setup."""

from __future__ import annotations

import json

import pytest

from .kubelet import container_env, shard_command
from .manifests import (DEPLOY, DOWNWARD, MIN_K8S, MONITORING_LABEL, RENDER_DIRS, REPO, TOKEN_SECRET, _renders, config,
                        container, is_custom_resource, kustomize_build, objects, one, render, render_tree, worker_job,
                        workloads)
from .netpol import (DNS_PORT, HTTPS_PORT, admits, assert_only_workers_reach_the_shards_stream_ports, peers, selects,
                     shard_ports)

kubernetes_validate = pytest.importorskip("kubernetes_validate")


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_networkpolicy_admits_only_workers_to_the_shards_stream_ports(rel):
    assert_only_workers_reach_the_shards_stream_ports(rel)


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_every_port_the_shard_listens_on_is_declared_in_the_service_and_admitted(rel):
    """The ports the shard's own CLI opens from the rendered command, against the pod's
    containerPorts, the Service and the NetworkPolicy: a listener missing from any of them (a
    data plane the policy forgot, say) or a port admitted where nothing listens fails here. The
    one exception by design is the tls component's health port, which only the kubelet reaches
    (from the pod's node, always allowed), so it is in neither the Service nor a policy."""
    assert_the_shards_listeners_are_declared_served_and_admitted(rel)


def assert_the_shards_listeners_are_declared_served_and_admitted(rel: str) -> dict[str, int]:
    _, _, shard = shard_command(rel)
    listening = {"grpc": shard.port, "metrics": shard.metrics_port}
    if shard.data_port >= 0:
        listening["data"] = shard.data_port
    if shard.health_port >= 0:
        listening["health"] = shard.health_port
    ports = shard_ports(rel)
    assert {name: port["containerPort"] for name, port in ports.items()} == listening
    served = {name: number for name, number in listening.items() if name != "health"}
    service_ports = one(rel, "Service", "cgx-ps-shard")["spec"]["ports"]
    assert {p["targetPort"]: p["port"] for p in service_ports} == served
    p = peers(rel)
    admitted = {name for name in ports for peer in p.values() if admits(rel, "Ingress", p["shard"], peer, ports[name])}
    assert admitted == set(served)
    return listening


def _render_with_components(*components: str) -> str:
    """cpu-local with each ``optional/<component>`` added, rendered into the cache; its render dir."""
    name = "_test-" + "+".join(components)
    test_overlay = render_tree() / "overlays" / name
    test_overlay.mkdir(exist_ok=True)
    listed = ", ".join(f"../../optional/{c}" for c in components)
    (test_overlay / "kustomization.yaml").write_text(f"resources: [../cpu-local]\ncomponents: [{listed}]\n")
    rel = f"overlays/{name}"
    _renders[rel] = kustomize_build(test_overlay)
    return rel


def test_the_raw_data_plane_is_off_by_default_and_the_data_plane_component_turns_it_on_everywhere():
    """Without optional/data-plane a shard listens on gRPC (and metrics) alone; with it on a
    plaintext overlay, the shard opens the plane and its port is in the pod, the Service and the
    policies, with the workers alone admitted to it (optional/worker-egress lets them out to it)."""
    assert set(assert_the_shards_listeners_are_declared_served_and_admitted("overlays/cpu-local")) == {"grpc",
                                                                                                      "metrics"}
    rel = _render_with_components("data-plane")
    for obj in render(rel):
        kubernetes_validate.validate(obj, MIN_K8S, strict=True)
    listening = assert_the_shards_listeners_are_declared_served_and_admitted(rel)
    assert set(listening) == {"grpc", "metrics", "data"}
    assert listening["data"] == int(config(rel)["CGX_PS_DATA_PORT"]) > 0
    assert_only_workers_reach_the_shards_stream_ports(rel)
    both = _render_with_components("data-plane", "worker-egress")
    p, ports = peers(both), shard_ports(both)
    assert admits(both, "Egress", p["worker"], p["shard"], ports["data"])


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_networkpolicy_denies_everything_else(rel):
    p = peers(rel)
    # Every pod of the job is isolated for ingress by one deny-all policy.
    deny_all = [pol for pol in objects(rel, "NetworkPolicy")
                if "Ingress" in pol["spec"].get("policyTypes", []) and not pol["spec"].get("ingress")]
    for w in workloads(rel):
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert [pol for pol in deny_all if selects(pol["spec"]["podSelector"], labels)], w["kind"]
    # Workers accept nothing (torchrun's rendezvous stays inside the pod).
    for name, peer in p.items():
        for port in (HTTPS_PORT, {"name": "c10d", "containerPort": 29500}):
            assert not admits(rel, "Ingress", p["worker"], peer, port), name
    # Shards open no connections at all: not even DNS.
    for name, peer in p.items():
        for port in (DNS_PORT, HTTPS_PORT, *shard_ports(rel).values()):
            assert not admits(rel, "Egress", p["shard"], peer, port), (name, port)


def test_worker_egress_component_allows_only_shards_and_dns():
    rel = _render_with_components("worker-egress")
    for obj in objects(rel, "NetworkPolicy"):
        kubernetes_validate.validate(obj, MIN_K8S, strict=True)
    p, ports = peers(rel), shard_ports(rel)
    worker = p["worker"]
    allowed = {(name, port["name"]) for name in p
               for port in (*ports.values(), DNS_PORT, {**DNS_PORT, "protocol": "TCP"}, HTTPS_PORT)
               if admits(rel, "Egress", worker, p[name], port)}
    assert allowed == {("shard", "grpc"), ("dns", "dns")}, allowed  # "data" too with optional/data-plane
    # The ingress side is the base's.
    assert_only_workers_reach_the_shards_stream_ports(rel)


GRAFANA_COMPONENT = "optional/grafana"


@pytest.mark.parametrize("base", ["cpu-local", "cpu-local-tls"])
def test_grafana_component_provisions_the_dashboard_and_worker_metrics(base):
    """The dashboard as a ConfigMap the Grafana sidecar picks up, and the workers' exporter
    (tests/test_dashboard.py checks the dashboard's queries against the code)."""
    tree = render_tree()
    test_overlay = tree / "overlays" / f"_test-grafana-{base}"
    test_overlay.mkdir(exist_ok=True)
    (test_overlay / "kustomization.yaml").write_text(
        f"resources: [../{base}]\ncomponents: [../../{GRAFANA_COMPONENT}]\n")
    rel = f"overlays/_test-grafana-{base}"
    _renders[rel] = kustomize_build(test_overlay)
    for obj in render(rel):
        if not is_custom_resource(obj):
            kubernetes_validate.validate(obj, MIN_K8S, strict=True)
    # the dashboard: labelled for the sidecar, a stable name, the committed JSON verbatim
    board = one(rel, "ConfigMap", "cgx-ps-grafana-dashboard")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    committed = (DEPLOY / GRAFANA_COMPONENT / "cgx-ps-dashboard.json").read_text()
    assert board["data"] == {"cgx-ps-dashboard.json": committed}
    assert json.loads(committed)["uid"] == "cgx-ps"
    # the workers' exporter: one port number, from cgx-ps-config, in the env, the port and the annotation
    job = worker_job(rel)
    port = int(config(rel)["CGX_PS_WORKER_METRICS_PORT"])
    worker = container(job, "worker")
    assert container_env(rel, worker, DOWNWARD)["CGX_PS_WORKER_METRICS_PORT"] == str(port)
    assert {p["name"]: p["containerPort"] for p in worker["ports"]} == {"metrics": port}
    ann = job["spec"]["template"]["metadata"]["annotations"]
    assert (ann["prometheus.io/scrape"], ann["prometheus.io/port"], ann["prometheus.io/path"]) == \
        ("true", str(port), "/metrics")
    assert port not in (int(config(rel)["CGX_PS_PORT"]), int(config(rel)["CGX_PS_METRICS_PORT"]), 29500)
    # only the monitoring namespace reaches it, and the shards' policy is unchanged
    p = peers(rel)
    metrics_port = worker["ports"][0]
    allowed = {name for name in p if admits(rel, "Ingress", p["worker"], p[name], metrics_port)}
    assert allowed == {"monitoring"}, allowed
    assert not admits(rel, "Ingress", p["worker"], p["monitoring"], HTTPS_PORT)
    assert_only_workers_reach_the_shards_stream_ports(rel)


def test_docs_describe_the_security_setup():
    docs = (REPO / "docs" / "deploy.md").read_text()
    for needle in (f"create secret generic {TOKEN_SECRET}", "=".join(MONITORING_LABEL),
                   "deploy/overlays/cpu-local/token", "optional/tls", "cert-manager",
                   "optional/worker-egress"):
        assert needle in docs, f"docs/deploy.md does not mention {needle}"
    policy = one("base", "NetworkPolicy", "cgx-ps-shard")
    monitoring_rules = [peer["namespaceSelector"]["matchLabels"]
                        for rule in policy["spec"]["ingress"] for peer in rule["from"] if "namespaceSelector" in peer]
    assert monitoring_rules == [dict([MONITORING_LABEL])]
