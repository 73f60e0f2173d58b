"""NetworkPolicy semantics (networking.k8s.io/v1), for "may this peer connect to that pod", and
the peers and ports of a rendered job that the policies are checked against."""

from __future__ import annotations

from .manifests import MONITORING_LABEL, container, objects, shard_sts, worker_job


def selects(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector; the empty selector selects everything."""
    selector = selector or {}
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


class Peer:
    """A pod: its labels, its namespace and that namespace's labels."""

    def __init__(self, labels: dict, namespace: str, namespace_labels: dict | None = None):
        self.labels, self.namespace = labels, namespace
        self.namespace_labels = {"kubernetes.io/metadata.name": namespace, **(namespace_labels or {})}


def _peer_matches(rule_peer: dict, peer: Peer, policy_namespace: str) -> bool:
    if "ipBlock" in rule_peer:
        return True   # an address range: may be anything, so count it as admitting the peer
    if "namespaceSelector" in rule_peer:
        if not selects(rule_peer["namespaceSelector"], peer.namespace_labels):
            return False
    elif peer.namespace != policy_namespace:
        return False
    return "podSelector" not in rule_peer or selects(rule_peer["podSelector"], peer.labels)


def _port_matches(rule_ports: list | None, port: dict) -> bool:
    """``port`` is a containerPort entry ({name, containerPort, protocol}) of the target pod."""
    if not rule_ports:
        return True
    for rp in rule_ports:
        if rp.get("protocol", "TCP") != port.get("protocol", "TCP"):
            continue
        if "port" not in rp or rp["port"] in (port.get("name"), port["containerPort"]):
            return True
        if isinstance(rp["port"], int) and rp.get("endPort", rp["port"]) >= port["containerPort"] >= rp["port"]:
            return True
    return False


def policies_for(rel: str, pod_labels: dict, direction: str) -> list[dict]:
    return [p for p in objects(rel, "NetworkPolicy")
            if selects(p["spec"]["podSelector"], pod_labels)
            and direction in p["spec"].get("policyTypes", ["Ingress"] + (["Egress"] if "egress" in p["spec"] else []))]


def admits(rel: str, direction: str, pod: Peer, other: Peer, port: dict) -> bool:
    """May ``other`` connect to ``pod`` (direction "Ingress"), or ``pod`` to ``other`` on
    ``other``'s ``port`` ("Egress"), as far as ``pod``'s policies decide?"""
    policies = policies_for(rel, pod.labels, direction)
    if not policies:
        return True   # not isolated
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for policy in policies:
        for rule in policy["spec"].get(key) or []:
            peers = rule.get(peers_key)
            if (not peers or any(_peer_matches(rp, other, pod.namespace) for rp in peers)) \
                    and _port_matches(rule.get("ports"), port):
                return True
    return False


def job_namespace(rel: str) -> tuple[str, dict]:
    """The namespace the job runs in: the overlay's own, or one given with `kubectl -n`."""
    ns = objects(rel, "Namespace")
    if ns:
        return ns[0]["metadata"]["name"], ns[0]["metadata"].get("labels", {})
    return "training", {}


def peers(rel: str) -> dict[str, Peer]:
    ns, ns_labels = job_namespace(rel)
    shard_labels = shard_sts(rel)["spec"]["template"]["metadata"]["labels"]
    worker_labels = worker_job(rel)["spec"]["template"]["metadata"]["labels"]
    return {
        "shard": Peer(shard_labels, ns, ns_labels),
        "worker": Peer(worker_labels, ns, ns_labels),
        "same-namespace pod": Peer({"app": "notebook"}, ns, ns_labels),
        "worker-labelled pod elsewhere": Peer(worker_labels, "other-team"),
        "monitoring": Peer({"app.kubernetes.io/name": "prometheus"}, "monitoring",
                           {MONITORING_LABEL[0]: MONITORING_LABEL[1]}),
        "unlabelled monitoring": Peer({"app.kubernetes.io/name": "prometheus"}, "metrics"),
        "dns": Peer({"k8s-app": "kube-dns"}, "kube-system"),
    }


def shard_ports(rel: str) -> dict[str, dict]:
    return {p["name"]: p for p in container(shard_sts(rel), "shard")["ports"]}


DNS_PORT = {"name": "dns", "containerPort": 53, "protocol": "UDP"}
HTTPS_PORT = {"name": "https", "containerPort": 443}


# The shard ports its workers stream on: gRPC, and the raw data plane where the shard has one.
STREAM_PORTS = ("grpc", "data")


def assert_only_workers_reach_the_shards_stream_ports(rel: str) -> None:
    """Workers, and nobody else, reach the shard's gRPC port and its data plane (where it has
    one: not with the tls component), and the monitoring namespace its metrics; nothing else."""
    p, ports = peers(rel), shard_ports(rel)
    shard = p["shard"]
    allowed = {(name, port) for name in p for port in ports
               if admits(rel, "Ingress", shard, p[name], ports[port])}
    streams = [port for port in STREAM_PORTS if port in ports]
    assert allowed == {("monitoring", "metrics"), *(("worker", port) for port in streams)}, allowed
    # ... and the worker's side lets it out (egress is open unless optional/worker-egress).
    for port in streams:
        assert admits(rel, "Egress", p["worker"], shard, ports[port]), port
    # Rule ports are names of the shard container's ports, so they follow cgx-ps-config.
    for policy in policies_for(rel, shard.labels, "Ingress"):
        for rule in policy["spec"].get("ingress") or []:
            for rp in rule.get("ports", []):
                assert rp["port"] in ports, f"{policy['metadata']['name']}: port {rp['port']} names no shard port"
