"""Offline checks of deploy/: the kustomize overlays, the images and the workers' init container
(`cgx-ps wait-for-shards`).

Every overlay is rendered with the real kustomize (`kubectl kustomize`, or a standalone
`kustomize build`; without either the rendering tests skip) from a copy of deploy/ in which
the inputs a user creates and never commits (the bearer token file) hold dummy values. Each
rendered object is validated against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict: no unknown fields) for the oldest supported and the newest packaged Kubernetes
version; cert-manager's custom resources have no schema there and are checked field by field
instead. The rest are the checks a schema cannot make: labels and selectors agree, numbers
agree with the one ConfigMap they come from, the shard command parses with the real cgx-ps
CLI, the worker command with torchrun and the training script, the NetworkPolicies admit
exactly the intended traffic, every pod mounts the token and TLS Secrets read-only, no secret
is committed, and so on.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path, PurePosixPath

import pytest
import yaml

from cgx_ps import wait_for_shards as wfs  # the init container's command, `cgx-ps wait-for-shards`
from cgx_ps.addresses import servers_from_env
from cgx_ps.examples import train as example_train  # the Job's training script (/app/examples/train.py)
from cgx_ps.security import ChannelSecurity
from cgx_ps.server.cluster import STARTUP_TIMEOUT_S, launch_shard, wait_for_port_file
from cgx_ps.server.sizing import shard_memory_mib

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.parent.name for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
RENDER_DIRS = ["base", *(f"overlays/{o}" for o in OVERLAYS)]
TLS_COMPONENT = "optional/tls"

# Oldest Kubernetes the manifests support: the StatefulSet pod-index label that gives a
# shard its index is on by default from 1.28 (native gRPC probes: 1.27, Indexed Jobs: 1.24).
MIN_K8S = "1.28"
CONFIG_NAME = "cgx-ps-config"
TOKEN_SECRET = "cgx-ps-token"
TOKEN_KEY = "token"
MONITORING_LABEL = ("cgx-ps.io/monitoring", "true")
SHARD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
NODE_RANK_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOB_ID_FIELD = "metadata.labels['batch.kubernetes.io/controller-uid']"
GPU = "nvidia.com/gpu"
# API groups of custom resources in deploy/: kubernetes-validate has no schemas for them.
CUSTOM_GROUPS = {"cert-manager.io"}



# ---------------------------------------------------------------------------------------
# rendering: the real kustomize


def _kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        try:
            ok = subprocess.run(["kubectl", "kustomize", "--help"], capture_output=True,
                                timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


KUSTOMIZE = _kustomize_command()
NO_KUSTOMIZE = ("neither kubectl nor kustomize is installed: rendering deploy/ needs kustomize v5 "
                "(kubectl >= 1.27 has it built in)")
_renders: dict[str, list[dict]] = {}
_tree: Path | None = None


def kustomizations(root: Path) -> list[Path]:
    return sorted(root.rglob("kustomization.yaml"))


def secret_generator_inputs(kfile: Path) -> list[Path]:
    """The files a kustomization's secretGenerators read (files: [key=]path, envs: path)."""
    k = yaml.safe_load(kfile.read_text()) or {}
    out = []
    for gen in k.get("secretGenerator", []):
        for entry in gen.get("files", []):
            out.append(kfile.parent / entry.split("=", 1)[-1])
        for entry in gen.get("envs", []):
            out.append(kfile.parent / entry)
    return out


def render_tree() -> Path:
    """A copy of deploy/ as a user has it before `kubectl apply -k`: the secretGenerator
    inputs they create (git-ignored, never committed) hold dummy values, so a test never
    reads a real token and passes on a fresh clone."""
    global _tree
    if _tree is None:
        tmp = Path(tempfile.mkdtemp(prefix="cgx-ps-deploy-"))
        atexit.register(shutil.rmtree, tmp, True)
        shutil.copytree(DEPLOY, tmp / "deploy", ignore=shutil.ignore_patterns("__pycache__"))
        for kfile in kustomizations(tmp / "deploy"):
            for path in secret_generator_inputs(kfile):
                text = "CGX_PS_DUMMY=1\n" if path.suffix == ".env" else "dummy-token-for-offline-tests"
                path.write_text(text)
        _tree = tmp / "deploy"
    return _tree


def kustomize_build(directory: Path) -> list[dict]:
    if KUSTOMIZE is None:
        pytest.skip(NO_KUSTOMIZE)
    out = subprocess.run([*KUSTOMIZE, str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kustomize {directory}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render(rel: str) -> list[dict]:
    if rel not in _renders:
        _renders[rel] = kustomize_build(render_tree() / rel)
    return _renders[rel]


def kustomization(rel: str) -> dict:
    return yaml.safe_load((DEPLOY / rel / "kustomization.yaml").read_text()) or {}


def uses_component(rel: str, component: str) -> bool:
    return any((DEPLOY / rel / c).resolve() == (DEPLOY / component).resolve()
               for c in kustomization(rel).get("components", []))


TLS_DIRS = [rel for rel in RENDER_DIRS if uses_component(rel, TLS_COMPONENT)]


def _id(obj: dict) -> tuple:
    return obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]


def objects(rel: str, kind: str) -> list[dict]:
    return [o for o in render(rel) if o["kind"] == kind]


def one(rel: str, kind: str, name: str | None = None) -> dict:
    found = [o for o in objects(rel, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"{rel}: expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def config(rel: str) -> dict[str, str]:
    cms = [o for o in objects(rel, "ConfigMap") if o["metadata"]["name"].startswith(CONFIG_NAME)]
    assert len(cms) == 1, f"{rel}: expected one {CONFIG_NAME} ConfigMap"
    return cms[0]["data"]


def shard_sts(rel: str) -> dict:
    return one(rel, "StatefulSet", "cgx-ps-shard")


def worker_job(rel: str) -> dict:
    return one(rel, "Job", "cgx-ps-train")


def container(pod_owner: dict, name: str, init: bool = False) -> dict:
    spec = pod_owner["spec"]["template"]["spec"]
    found = [c for c in spec.get("initContainers" if init else "containers", []) if c["name"] == name]
    assert len(found) == 1, f"no container {name}"
    return found[0]


def all_containers(pod_owner: dict) -> list[dict]:
    spec = pod_owner["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def workloads(rel: str) -> list[dict]:
    return objects(rel, "StatefulSet") + objects(rel, "Job") + objects(rel, "Deployment")


# ---------------------------------------------------------------------------------------
# the kubelet's view of a container: env (envFrom, then env in order) and $(VAR) expansion

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: $$ is a literal $, unknown references stay verbatim."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def container_env(rel: str, c: dict, downward: dict[str, str] | None = None) -> dict[str, str]:
    cm_names = {o["metadata"]["name"]: o["data"] for o in objects(rel, "ConfigMap")}
    env: dict[str, str] = {}
    for ef in c.get("envFrom", []):
        ref = ef["configMapRef"]["name"]
        assert ref in cm_names, f"envFrom names ConfigMap {ref}, not in the render"
        env.update(cm_names[ref])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
        elif "fieldRef" in e.get("valueFrom", {}):
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert downward is not None and path in downward, f"unexpected downward API field {path}"
            env[e["name"]] = downward[path]
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = cm_names[ref["name"]][ref["key"]]
        else:
            raise AssertionError(f"unhandled env source {e}")
    return env


def expanded_args(c: dict, env: dict[str, str], field: str = "args") -> list[str]:
    out = [expand(str(a), env) for a in c.get(field, [])]
    unresolved = [a for a in out if re.search(r"\$\([^)]*\)", a)]
    assert not unresolved, f"{c['name']}: {field} reference undefined variables: {unresolved}"
    return out


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_entrypoint(path: Path) -> list[str]:
    entry = [rest for word, rest in dockerfile_instructions(path) if word == "ENTRYPOINT"]
    assert entry, f"{path}: no ENTRYPOINT"
    return json.loads(entry[-1])   # exec form, so that signals reach the process


def parse_quantity(q) -> float:
    """A Kubernetes quantity in base units (bytes, cores)."""
    s = str(q)
    suffixes = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6,
                "G": 1e9, "T": 1e12, "m": 1e-3}
    for suffix, factor in suffixes.items():
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * factor
    return float(s)


def split_image(ref: str) -> tuple[str, str | None, str | None]:
    """An image reference as (name, tag, digest)."""
    name, _, digest = ref.partition("@")
    slash, colon = name.rfind("/"), name.rfind(":")
    if colon > slash:
        return name[:colon], name[colon + 1:], digest or None
    return name, None, digest or None


# ---------------------------------------------------------------------------------------
# files a container sees: which Secret a path comes from


def pod_spec(pod_owner: dict) -> dict:
    return pod_owner["spec"]["template"]["spec"]


def secret_file(pod_owner: dict, c: dict, path: str) -> tuple[dict, dict, str]:
    """(volumeMount, volume, key) of the Secret volume that puts a file at ``path`` in ``c``."""
    p = PurePosixPath(path)
    volumes = {v["name"]: v for v in pod_spec(pod_owner).get("volumes", [])}
    for m in c.get("volumeMounts", []):
        root = PurePosixPath(m["mountPath"])
        if root not in p.parents:
            continue
        assert "subPath" not in m, (f"{c['name']}: {m['mountPath']} uses subPath; the kubelet never "
                                    "updates such a file when the Secret changes")
        vol = volumes[m["name"]]
        assert "secret" in vol, f"{c['name']}: {path} is not from a Secret volume"
        rel_path = str(p.relative_to(root))
        items = vol["secret"].get("items")
        if items is None:
            return m, vol, rel_path
        keys = [i["key"] for i in items if i["path"] == rel_path]
        assert keys, f"{c['name']}: the Secret volume {vol['name']} projects no item to {rel_path}"
        return m, vol, keys[0]
    raise AssertionError(f"{c['name']}: nothing is mounted at {path}")


def readable_only_by_the_pod_user(pod_owner: dict, vol: dict) -> bool:
    """The Secret's files are readable by the pod's (non-root) user, and by nobody else."""
    mode = vol["secret"].get("defaultMode", 0o644)
    sc = pod_spec(pod_owner)["securityContext"]
    groups = {sc.get("fsGroup")} | set(sc.get("supplementalGroups", []))
    readable = bool(mode & 0o004) or (bool(mode & 0o040) and sc.get("runAsGroup") in groups)
    return readable and not mode & 0o007 and not mode & 0o222


# ---------------------------------------------------------------------------------------
# NetworkPolicy semantics (networking.k8s.io/v1), for "may this peer connect to that pod"


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


# ---------------------------------------------------------------------------------------
# rendering and schema validation


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_renders(rel):
    objs = render(rel)
    kinds = sorted(o["kind"] for o in objs)
    for kind in ("ConfigMap", "Job", "NetworkPolicy", "PodDisruptionBudget", "Service", "StatefulSet"):
        assert kind in kinds, f"{rel}: no {kind}"
    assert len({_id(o) for o in objs}) == len(objs)


def is_custom_resource(obj: dict) -> bool:
    return obj["apiVersion"].split("/")[0] in CUSTOM_GROUPS


@pytest.mark.parametrize("k8s", [MIN_K8S, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_objects_validate_strictly(rel, k8s):
    # Every built-in object strictly; cert-manager's custom resources have no schema in
    # kubernetes-validate (test_cert_manager_objects checks their fields instead).
    for obj in render(rel):
        if is_custom_resource(obj):
            continue
        try:
            kubernetes_validate.validate(obj, k8s, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = ".".join(str(p) for p in err.path)
            pytest.fail(f"{rel}: {obj['kind']}/{obj['metadata']['name']} invalid for "
                        f"Kubernetes {k8s} at {path}: {err.message}")


def test_overlays_exist():
    assert {"cpu-local", "cpu-local-tls", "gpu"} <= set(OVERLAYS)
    assert "overlays/cpu-local-tls" in TLS_DIRS


def test_replacement_blocks_are_identical_copies():
    """Overlays that merge values into cgx-ps-config re-run the base's replacements verbatim
    (see deploy/base/kustomization.yaml)."""
    base = kustomization("base")["replacements"]
    for overlay in OVERLAYS:
        k = kustomization(f"overlays/{overlay}")
        if any(g["name"] == CONFIG_NAME for g in k.get("configMapGenerator", [])):
            assert k["replacements"][: len(base)] == base, f"{overlay}: replacements drifted from base"


def test_tls_component_is_not_inside_an_overlay_that_repeats_the_replacements():
    """kustomize runs a kustomization's replacements after its components: the base block,
    repeated in an overlay that also includes the tls component, would point the probes
    back at the TLS port (the rendered probes are checked too, for the shipped overlays)."""
    for rel in TLS_DIRS:
        assert "replacements" not in kustomization(rel), rel


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.startswith("cpu-local")])
def test_cpu_local_is_self_contained(overlay):
    """`kubectl apply -k deploy/overlays/cpu-local` on an empty cluster: it brings its namespace."""
    rel = f"overlays/{overlay}"
    objs = render(rel)
    ns = one(rel, "Namespace")
    assert objs[0] is ns, "the Namespace must be applied first"
    for o in objs[1:]:
        assert o["metadata"].get("namespace") == ns["metadata"]["name"], _id(o)


def test_generated_names_carry_the_content_hash():
    """A changed value renames the ConfigMap (and the cpu-local token Secret), and the pods
    that reference it change with it: that is what rolls the shards."""
    for rel in RENDER_DIRS:
        names = [o["metadata"]["name"] for o in objects(rel, "ConfigMap")]
        assert [n for n in names if re.fullmatch(rf"{CONFIG_NAME}-[a-z0-9]{{10}}", n)], rel
    secret = one("overlays/cpu-local", "Secret")
    assert re.fullmatch(rf"{TOKEN_SECRET}-[a-z0-9]{{10}}", secret["metadata"]["name"])
    for w in workloads("overlays/cpu-local"):
        refs = [v["secret"]["secretName"] for v in pod_spec(w)["volumes"]
                if v.get("secret", {}).get("secretName", "").startswith(TOKEN_SECRET)]
        assert refs == [secret["metadata"]["name"]], w["kind"]


# ---------------------------------------------------------------------------------------
# labels, selectors, services


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_selectors_match_template_labels(rel):
    sts = shard_sts(rel)
    shard_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert _selects(sts["spec"]["selector"]["matchLabels"], shard_labels)
    for tsc in sts["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
        assert _selects(tsc["labelSelector"]["matchLabels"], shard_labels)
    worker_labels = worker_job(rel)["spec"]["template"]["metadata"]["labels"]
    for obj in objects(rel, "Service"):
        assert _selects(obj["spec"]["selector"], shard_labels)
        assert not _selects(obj["spec"]["selector"], worker_labels)


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_pdb_covers_shards_only(rel):
    pdbs = objects(rel, "PodDisruptionBudget")
    assert len(pdbs) == 1
    sel = pdbs[0]["spec"]["selector"]["matchLabels"]
    assert _selects(sel, shard_sts(rel)["spec"]["template"]["metadata"]["labels"])
    assert not _selects(sel, worker_job(rel)["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_statefulset_service_is_headless(rel):
    sts = shard_sts(rel)
    svc = one(rel, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    port_names = {p["name"] for p in container(sts, "shard")["ports"]}
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in port_names


# ---------------------------------------------------------------------------------------
# one source of truth: the ConfigMap


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_counts_and_ports_agree_with_the_configmap(rel):
    cfg = config(rel)
    shards, nodes = int(cfg["CGX_PS_NUM_SHARDS"]), int(cfg["CGX_PS_NUM_NODES"])
    port, metrics_port = int(cfg["CGX_PS_PORT"]), int(cfg["CGX_PS_METRICS_PORT"])
    sts, job = shard_sts(rel), worker_job(rel)
    assert sts["spec"]["replicas"] == shards
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nodes

    c = container(sts, "shard")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    expected = {"grpc": port, "metrics": metrics_port}
    if rel in TLS_DIRS:   # the kubelet probes a plaintext health-only port (test_tls_probes_...)
        expected["health"] = int(cfg["CGX_PS_HEALTH_PORT"])
    assert ports == expected
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe_port = c[probe]["grpc"]["port"]
        assert isinstance(probe_port, int) and probe_port == expected.get("health", port), probe
    svc_ports = {p["name"]: p["port"] for p in one(rel, "Service", "cgx-ps-shard")["spec"]["ports"]}
    assert svc_ports == {"grpc": port, "metrics": metrics_port}
    ann = sts["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == str(metrics_port)
    assert ann["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_workers_derive_shard_addresses_from_the_same_count(rel):
    cfg = config(rel)
    sts = shard_sts(rel)
    job = worker_job(rel)
    expected = [f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{cfg['CGX_PS_PORT']}"
                for i in range(int(cfg["CGX_PS_NUM_SHARDS"]))]
    downward = {NODE_RANK_FIELD: "0", JOB_ID_FIELD: "3f2c-uid"}
    for c in all_containers(job):
        env = container_env(rel, c, downward)
        assert env["CGX_PS_NUM_SHARDS"] == cfg["CGX_PS_NUM_SHARDS"]
        assert "{i}" in env["CGX_PS_SERVERS"], "use the {i} template, not a hand-written list"
        assert list(servers_from_env(env)) == expected
    worker = container(job, "worker")
    node_rank = [e for e in worker["env"] if e["name"] == "CGX_PS_NODE_RANK"]
    assert node_rank and node_rank[0]["valueFrom"]["fieldRef"]["fieldPath"] == NODE_RANK_FIELD
    assert container_env(rel, worker, downward)["CGX_PS_NUM_NODES"] == cfg["CGX_PS_NUM_NODES"]


# ---------------------------------------------------------------------------------------
# the shard command: the real CLI


def test_image_entrypoint_is_the_cli():
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        assert dockerfile_entrypoint(DEPLOY / dockerfile) == ["cgx-ps"]
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["cgx-ps"] == "cgx_ps.cli:main"


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_shard_command_parses_with_the_cli(rel, monkeypatch):
    from cgx_ps import cli

    cfg = config(rel)
    sts = shard_sts(rel)
    c = container(sts, "shard")
    env = container_env(rel, c, {SHARD_INDEX_FIELD: "1"})
    argv = (c.get("command") or dockerfile_entrypoint(DEPLOY / "Dockerfile")) + expanded_args(c, env)
    assert argv[0] == "cgx-ps"
    # The CLI reads its defaults from the environment when the parser is built.
    for key in [k for k in os.environ if k.startswith("CGX_PS_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = cli.build_parser().parse_args(argv[1:])
    assert args.command == "server"
    assert args.host == "0.0.0.0"
    assert args.port == int(cfg["CGX_PS_PORT"])
    assert args.metrics_port == int(cfg["CGX_PS_METRICS_PORT"])
    assert args.num_shards == int(cfg["CGX_PS_NUM_SHARDS"]) == sts["spec"]["replicas"]
    assert args.shard_index == 1                                  # from the downward API
    assert args.round_timeout == float(cfg["CGX_PS_ROUND_TIMEOUT"])
    assert args.drain_timeout == float(cfg["CGX_PS_DRAIN_TIMEOUT"])
    assert args.max_inflight_mb == float(cfg["CGX_PS_MAX_INFLIGHT_MB"])
    assert args.log_level == cfg["CGX_PS_LOG_LEVEL"]
    assert args.error_feedback is (cfg["CGX_PS_ERROR_FEEDBACK"] not in ("", "0", "false"))
    index_env = [e for e in c["env"] if e["name"] == "CGX_PS_SHARD_INDEX"]
    assert index_env[0]["valueFrom"]["fieldRef"]["fieldPath"] == SHARD_INDEX_FIELD
    # Security: the token always; TLS (mutual) and the plaintext health port with the tls component.
    assert args.token_file == env["CGX_PS_TOKEN_FILE"]
    secret_file(sts, c, args.token_file)
    if rel in TLS_DIRS:
        assert (args.tls_cert, args.tls_key, args.tls_client_ca) == (
            env["CGX_PS_TLS_CERT"], env["CGX_PS_TLS_KEY"], env["CGX_PS_TLS_CLIENT_CA"])
        assert args.health_port == int(cfg["CGX_PS_HEALTH_PORT"]) > 0
        assert args.health_port not in (args.port, args.metrics_port)
    else:
        assert not (args.tls_cert or args.tls_key or args.tls_client_ca)
        assert args.health_port == -1
    assert not args.metrics_host or args.metrics_host == args.host


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_grace_period_exceeds_drain_timeout(rel):
    drain = float(config(rel)["CGX_PS_DRAIN_TIMEOUT"])
    grace = shard_sts(rel)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # The drain itself, then closing streams and the metrics server: leave 10 s for those.
    assert grace >= drain + 10


# ---------------------------------------------------------------------------------------
# the worker command: torchrun + the example training script


def _torchrun_args(rel: str):
    from torch.distributed.run import get_args_parser

    c = container(worker_job(rel), "worker")
    env = container_env(rel, c, {NODE_RANK_FIELD: "0", JOB_ID_FIELD: "3f2c-uid"})
    argv = expanded_args(c, env, "command") + expanded_args(c, env)
    assert argv[0] == "torchrun"
    return get_args_parser().parse_args(argv[1:]), env


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_worker_command_is_one_torchrun_per_node(rel):
    targs, env = _torchrun_args(rel)
    assert targs.standalone
    assert str(targs.nproc_per_node) == config(rel)["GPUS_PER_NODE"]
    # a failed rank restarts the pod's ranks in place (a new incarnation resuming from the checkpoint)
    assert targs.max_restarts == int(config(rel)["TORCHRUN_MAX_RESTARTS"]) >= 1
    assert targs.training_script == "/app/examples/train.py"
    # The image puts the package's example script at /app/examples/train.py.
    copies = [rest.split() for word, rest in dockerfile_instructions(DEPLOY / "Dockerfile") if word == "COPY"]
    assert ["cgx_ps/examples/train.py", "/app/examples/train.py"] in copies


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_worker_args_parse_with_the_training_script(rel):
    targs, env = _torchrun_args(rel)
    # the image copies cgx_ps/examples/train.py there (test_worker_command_is_one_torchrun_per_node)
    assert Path(targs.training_script).name == Path(example_train.__file__).name, targs.training_script
    args = example_train.build_parser().parse_args(targs.training_script_args)
    cfg = config(rel)
    assert args.epochs == int(cfg["TRAIN_EPOCHS"])
    assert args.batch_size == int(cfg["TRAIN_BATCH_SIZE"])
    assert args.compression == cfg["CGX_PS_COMPRESSION"]
    assert args.checkpoint == cfg["TRAIN_CHECKPOINT_DIR"] and args.checkpoint_every == int(cfg["TRAIN_CHECKPOINT_EVERY"])
    mounts = {m["mountPath"]: m["name"] for m in container(worker_job(rel), "worker")["volumeMounts"]}
    assert mounts.get(args.checkpoint) == "checkpoints", "checkpoints go to their own volume, not the container"


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_job_shape(rel):
    job = worker_job(rel)
    spec = job["spec"]
    nodes = int(config(rel)["CGX_PS_NUM_NODES"])
    assert spec["completionMode"] == "Indexed"
    assert spec["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    # One lost node fails every node's round: allow at least one such incident, at most two.
    assert nodes <= spec["backoffLimit"] <= 2 * nodes
    pod = spec["template"]["spec"]
    shm = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
    mounts = {m["mountPath"]: m["name"] for m in container(job, "worker")["volumeMounts"]}
    assert mounts.get("/dev/shm") == "dshm"
    limit = parse_quantity(container(job, "worker")["resources"]["limits"]["memory"])
    assert parse_quantity(shm[0]["emptyDir"]["sizeLimit"]) < limit, "/dev/shm counts against the memory limit"
    # a drained or preempted pod is replaced without using up backoffLimit
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    init = container(job, "wait-for-shards", init=True)
    assert "command" not in init, "the image's entrypoint (the cgx-ps CLI) runs `cgx-ps wait-for-shards`"
    assert init_args(init).command == "wait-for-shards"


# ---------------------------------------------------------------------------------------
# resources and pod hygiene


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_every_container_requests_cpu_and_memory(rel):
    for w in workloads(rel):
        for c in all_containers(w):
            requests = c.get("resources", {}).get("requests", {})
            assert "cpu" in requests and "memory" in requests, f"{w['kind']}/{c['name']}"
            if "memory" in c["resources"].get("limits", {}):
                assert parse_quantity(requests["memory"]) <= parse_quantity(c["resources"]["limits"]["memory"])


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_shards_are_guaranteed_qos(rel):
    sts = shard_sts(rel)
    for c in all_containers(sts):
        res = c["resources"]
        assert set(res["requests"]) == {"cpu", "memory"}
        assert res["requests"] == res["limits"], c["name"]
    # The memory limit covers the shard's caps by the measured rule (benchmarks/shard_memory.py).
    mem_mib = parse_quantity(container(sts, "shard")["resources"]["limits"]["memory"]) / 2**20
    cfg = config(rel)
    need = shard_memory_mib(float(cfg["CGX_PS_MAX_INFLIGHT_MB"]), float(cfg["CGX_PS_MAX_MODEL_MB"]),
                            cfg["CGX_PS_ERROR_FEEDBACK"] not in ("", "0", "false"),
                            int(cfg["CGX_PS_MAX_CONCURRENT_RPCS"]))
    assert mem_mib >= need, f"{rel}: shard memory limit {mem_mib:.0f} MiB < {need:.0f} MiB its caps need"


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_gpus_only_in_limits(rel):
    for w in workloads(rel):
        for c in all_containers(w):
            res = c.get("resources", {})
            assert GPU not in res.get("requests", {}), f"{w['kind']}/{c['name']}: GPUs in requests"
    for c in all_containers(shard_sts(rel)):
        assert GPU not in c["resources"].get("limits", {}), "shards sum on the CPU"
    limits = container(worker_job(rel), "worker")["resources"].get("limits", {})
    if rel == "overlays/gpu":
        assert limits[GPU] == int(config(rel)["GPUS_PER_NODE"])
    else:
        assert GPU not in limits


def test_gpu_overlay_uses_the_gpu_image_for_workers_only():
    job = worker_job("overlays/gpu")
    for c in all_containers(job):
        assert split_image(c["image"])[0].endswith("/cgx-ps-gpu")
    for c in all_containers(shard_sts("overlays/gpu")):
        assert split_image(c["image"])[0].endswith("/cgx-ps")
    for rel in ("base", "overlays/cpu-local"):
        for w in workloads(rel):
            for c in all_containers(w):
                assert split_image(c["image"])[0] == "cgx-ps"


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_pods_meet_the_restricted_pod_security_standard(rel):
    for w in workloads(rel):
        pod = w["spec"]["template"]["spec"]
        assert pod["enableServiceLinks"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"].get("runAsUser", 1) != 0
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for v in pod.get("volumes", []):
            assert set(v) - {"name"} <= {"emptyDir", "configMap", "secret", "projected",
                                          "persistentVolumeClaim", "downwardAPI", "ephemeral"}
        for c in all_containers(w):
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, c["name"]
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), c["name"]
            assert not sc.get("privileged"), c["name"]


# ---------------------------------------------------------------------------------------
# the optional ServiceMonitor


def test_servicemonitor_is_optional_and_matches_the_service():
    path = DEPLOY / "optional" / "servicemonitor.yaml"
    sm = yaml.safe_load(path.read_text())
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["kind"] == "ServiceMonitor"
    for kfile in DEPLOY.rglob("kustomization.yaml"):
        assert "servicemonitor" not in kfile.read_text().lower(), f"{kfile} pulls in the CRD-backed ServiceMonitor"
    for rel in RENDER_DIRS:
        svc = one(rel, "Service", "cgx-ps-shard")
        assert _selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
        names = {p["name"] for p in svc["spec"]["ports"]}
        for ep in sm["spec"]["endpoints"]:
            assert ep["port"] in names
            assert ep["path"] == "/metrics"


# ---------------------------------------------------------------------------------------
# the images


def _from_images(path: Path) -> list[str]:
    ins = dockerfile_instructions(path)
    args = {}
    for word, rest in ins:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v
    images = []
    for word, rest in ins:
        if word == "FROM":
            ref = rest.split()[0]
            images.append(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref))
    return images


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_is_pinned_and_non_root(dockerfile):
    path = DEPLOY / dockerfile
    for image in _from_images(path):
        name, tag, digest = split_image(image)
        assert digest or (tag and tag != "latest" and re.search(r"\d+\.\d+", tag)), image
    ins = dockerfile_instructions(path)
    users = [rest for word, rest in ins if word == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*(:\d+)?", users[-1]), "numeric non-root USER"
    args = dict(rest.split("=", 1) for word, rest in ins if word == "ARG" and "=" in rest)
    assert args["TORCH_VERSION"].startswith("2.13.0")
    text = path.read_text()
    assert "--constraint /tmp/constraints.txt" in text
    # Everything the build copies from the context exists and passes the .dockerignore.
    allowed = [w[1:].rstrip("/") for w in (DEPLOY / f"{dockerfile}.dockerignore").read_text().split()
               if w.startswith("!")]
    for word, rest in ins:
        if word == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert (REPO / src).exists(), f"{dockerfile}: COPY {src}: missing in the repository"
                assert any(src == a or src.startswith(a + "/") for a in allowed), \
                    f"{dockerfile}.dockerignore excludes {src}"


def test_cupy_only_in_the_gpu_image():
    cpu = " ".join(f"{w} {r}" for w, r in dockerfile_instructions(DEPLOY / "Dockerfile")).lower()
    gpu = (DEPLOY / "Dockerfile.gpu").read_text()
    assert "cupy" not in cpu and "[cuda" not in cpu and "cgx_ps_extra" not in cpu
    assert any(img.startswith("nvidia/cuda:") for img in _from_images(DEPLOY / "Dockerfile.gpu"))
    args = dict(rest.split("=", 1) for word, rest in dockerfile_instructions(DEPLOY / "Dockerfile.gpu")
                if word == "ARG" and "=" in rest)
    assert args["CGX_PS_EXTRA"] == "cuda12"
    assert '"/src[${CGX_PS_EXTRA}]"' in gpu


def test_constraints_pin_exact_versions():
    import tomllib

    pins = {}
    for line in (DEPLOY / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][0-9A-Za-z.+-]*)", line)
            assert m, f"not an exact pin: {line}"
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = list(project["dependencies"]) + list(project["optional-dependencies"]["cuda12"])
    for dep in deps:
        name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0).lower().replace("_", "-")
        assert name in pins, f"{name} (a cgx-ps dependency) is not pinned in deploy/constraints.txt"


# ---------------------------------------------------------------------------------------
# security: NetworkPolicies


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


def assert_only_workers_reach_the_shards_grpc_port(rel: str) -> None:
    p, ports = peers(rel), shard_ports(rel)
    shard = p["shard"]
    allowed = {(name, port) for name in p for port in ports
               if admits(rel, "Ingress", shard, p[name], ports[port])}
    assert allowed == {("worker", "grpc"), ("monitoring", "metrics")}, allowed
    # ... and the worker's side lets it out (egress is open unless optional/worker-egress).
    assert admits(rel, "Egress", p["worker"], shard, ports["grpc"])
    # Rule ports are names of the shard container's ports, so they follow cgx-ps-config.
    for policy in policies_for(rel, shard.labels, "Ingress"):
        for rule in policy["spec"].get("ingress") or []:
            for rp in rule.get("ports", []):
                assert rp["port"] in ports, f"{policy['metadata']['name']}: port {rp['port']} names no shard port"


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_networkpolicy_admits_only_workers_to_the_shards_grpc_port(rel):
    assert_only_workers_reach_the_shards_grpc_port(rel)


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
    tree = render_tree()
    test_overlay = tree / "overlays" / "_test-worker-egress"
    test_overlay.mkdir(exist_ok=True)
    (test_overlay / "kustomization.yaml").write_text(
        "resources: [../cpu-local]\ncomponents: [../../optional/worker-egress]\n")
    rel = "overlays/_test-worker-egress"
    _renders[rel] = kustomize_build(test_overlay)
    for obj in objects(rel, "NetworkPolicy"):
        kubernetes_validate.validate(obj, MIN_K8S, strict=True)
    p, ports = peers(rel), shard_ports(rel)
    worker = p["worker"]
    allowed = {(name, port["name"]) for name in p
               for port in (*ports.values(), DNS_PORT, {**DNS_PORT, "protocol": "TCP"}, HTTPS_PORT)
               if admits(rel, "Egress", worker, p[name], port)}
    assert allowed == {("shard", "grpc"), ("dns", "dns")}, allowed
    # The ingress side is the base's.
    assert_only_workers_reach_the_shards_grpc_port(rel)


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
    assert_only_workers_reach_the_shards_grpc_port(rel)


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


# ---------------------------------------------------------------------------------------
# security: the bearer token


def talking_containers(rel: str) -> list[tuple[dict, dict]]:
    """(pod owner, container) for every container that calls or serves ParameterServer RPCs."""
    return [(shard_sts(rel), container(shard_sts(rel), "shard")),
            (worker_job(rel), container(worker_job(rel), "worker"))]


DOWNWARD = {SHARD_INDEX_FIELD: "0", NODE_RANK_FIELD: "0", JOB_ID_FIELD: "3f2c-uid"}


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_every_pod_mounts_the_token_secret_read_only(rel):
    generated = {o["metadata"]["name"]: o for o in objects(rel, "Secret")}
    for owner, c in talking_containers(rel):
        env = container_env(rel, c, DOWNWARD)
        assert "CGX_PS_TOKEN_FILE" in env, f"{c['name']}: no CGX_PS_TOKEN_FILE"
        mount, vol, key = secret_file(owner, c, env["CGX_PS_TOKEN_FILE"])
        assert mount.get("readOnly") is True, c["name"]
        assert key == TOKEN_KEY
        name = vol["secret"]["secretName"]
        # The user's Secret (base, gpu), or the overlay's generated one (cpu-local).
        assert name == TOKEN_SECRET or (name.startswith(f"{TOKEN_SECRET}-") and name in generated), name
        assert not vol["secret"].get("optional"), "a missing token must stop the pod, not disable auth"
        assert readable_only_by_the_pod_user(owner, vol), vol
    # Least privilege: the init container only calls the (open) health service.
    init = container(worker_job(rel), "wait-for-shards", init=True)
    assert "CGX_PS_TOKEN_FILE" not in container_env(rel, init, DOWNWARD)
    for secret in generated.values():
        assert secret["metadata"]["name"].startswith(f"{TOKEN_SECRET}-"), "only the token is generated"


def test_cpu_local_generates_the_token_from_the_ignored_file():
    import base64

    secret = one("overlays/cpu-local", "Secret")
    # render_tree() put the dummy there: the Secret holds exactly the file the user creates.
    assert base64.b64decode(secret["data"][TOKEN_KEY]) == b"dummy-token-for-offline-tests"
    inputs = secret_generator_inputs(DEPLOY / "overlays" / "cpu-local" / "kustomization.yaml")
    assert [p.name for p in inputs] == [TOKEN_KEY]
    assert f"/{TOKEN_KEY}" in (DEPLOY / "overlays" / "cpu-local" / ".gitignore").read_text().split()


def committed_files(root: Path) -> list[Path]:
    """Files under ``root`` that git would commit (tracked, or new and not ignored)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard", "--", str(root.relative_to(REPO))],
                             capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        out = None
    if out is None or out.returncode != 0:
        return [p for p in root.rglob("*") if p.is_file()]   # no git: every file counts
    return [REPO / name for name in out.stdout.decode().split("\0") if name and (REPO / name).is_file()]


def test_no_secret_material_is_committed():
    files = committed_files(DEPLOY)
    assert DEPLOY / "base" / "kustomization.yaml" in files
    for path in files:
        data = path.read_bytes()
        assert b"-----BEGIN" not in data, f"{path}: a PEM block (key or certificate) is committed"
        if path.suffix in (".yaml", ".yml"):
            for doc in yaml.safe_load_all(data):
                if isinstance(doc, dict) and doc.get("kind") == "Secret":
                    assert not doc.get("data") and not doc.get("stringData"), f"{path}: a Secret with data"
        if path.name == "kustomization.yaml":
            k = yaml.safe_load(data) or {}
            for gen in k.get("secretGenerator", []):
                assert "literals" not in gen, f"{path}: secretGenerator literals are committed secrets"
            for generated_from in secret_generator_inputs(path):
                assert generated_from not in files, f"{generated_from} would be committed"


# ---------------------------------------------------------------------------------------
# security: TLS (deploy/optional/tls, cert-manager)


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


# ---------------------------------------------------------------------------------------
# `cgx-ps wait-for-shards` (the workers' init container)


def init_args(init: dict, *extra: str):
    """The init container's arguments (the image's entrypoint is the cgx-ps CLI), parsed by
    the real CLI, with ``extra`` appended."""
    from cgx_ps import cli

    argv = dockerfile_entrypoint(DEPLOY / "Dockerfile") + list(init["args"]) + list(extra)
    assert argv[0] == "cgx-ps"
    return cli.build_parser().parse_args(argv[1:])


def wait_main(env: dict[str, str], *argv: str) -> int:
    from cgx_ps import cli

    return wfs.run_wait_for_shards(cli.build_parser().parse_args(["wait-for-shards", *argv]), env=env)


def test_shard_addresses():
    assert servers_from_env({"CGX_PS_SERVERS": "s-{i}.s:7070", "CGX_PS_NUM_SHARDS": "3"}) == (
        "s-0.s:7070", "s-1.s:7070", "s-2.s:7070")
    assert servers_from_env({"CGX_PS_SERVERS": "a:1, b:2"}) == ("a:1", "b:2")
    for bad in ({"CGX_PS_SERVERS": "a:1,b:2", "CGX_PS_NUM_SHARDS": "3"}, {"CGX_PS_SERVERS": "s-{i}:1"},
                {"CGX_PS_SERVERS": "nohostport"}, {}):
        with pytest.raises(ValueError):
            servers_from_env(bad)
    assert wait_main({}) == 2
    assert wait_main({}, "--servers", "a:1,b:2", "--num-shards", "3") == 2


@pytest.fixture
def health_server():
    import grpc
    from concurrent import futures
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    yield f"127.0.0.1:{port}", servicer, health_pb2
    server.stop(None)


def test_wait_for_shards_waits_for_serving(health_server):
    address, servicer, health_pb2 = health_server
    lines: list[str] = []
    assert wfs.wait([address], timeout=0.5, interval=0.1, rpc_timeout=0.5, log=lines.append) is False
    assert "NOT_SERVING" in lines[-1]
    timer = threading.Timer(0.5, servicer.set, ("", health_pb2.HealthCheckResponse.SERVING))
    timer.start()
    try:
        t0 = time.monotonic()
        assert wfs.wait([address], timeout=10, interval=0.1, rpc_timeout=0.5, log=lines.append)
        assert time.monotonic() - t0 < 5
    finally:
        timer.cancel()


def test_wait_for_shards_times_out_on_a_missing_shard(health_server):
    address, servicer, health_pb2 = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    lines: list[str] = []
    # 127.0.0.1:1 refuses connections: UNAVAILABLE, named in the last line.
    assert wfs.wait([address, "127.0.0.1:1"], timeout=1, interval=0.2, rpc_timeout=0.3,
                    log=lines.append) is False
    assert "127.0.0.1:1 (UNAVAILABLE)" in lines[-1]


def test_wait_for_shards_command_as_the_init_container_runs_it(health_server):
    """The CLI in a process of its own: exit 0 once SERVING, 1 naming the missing shard on
    timeout, and no torch imported (the init container's memory limit is 256 MiB)."""
    address, servicer, health_pb2 = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    init = container(worker_job("base"), "wait-for-shards", init=True)
    script = ("import sys; from cgx_ps.cli import main; rc = main(sys.argv[1:]); "
              "assert 'torch' not in sys.modules, 'wait-for-shards imported torch'; sys.exit(rc)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_PS_")}

    def run(servers: str) -> subprocess.CompletedProcess:
        args = [*init["args"], "--timeout", "2", "--interval", "0.2"]
        return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60,
                              env={**env, "CGX_PS_SERVERS": servers})

    ok = run(address)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"{address} is SERVING" in ok.stdout
    late = run(f"{address},127.0.0.1:1")
    assert late.returncode == 1, late.stdout + late.stderr
    assert "still waiting for 127.0.0.1:1 (UNAVAILABLE)" in late.stdout.splitlines()[-1]


@pytest.fixture
def pki(tmp_path):
    """A throwaway CA (trustme), a shard certificate for the dnsNames of the rendered
    Certificate and a worker client certificate, as the files cert-manager's Secrets hold."""
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


def materialize(env: dict[str, str], root: Path, files: dict[str, bytes]) -> dict[str, str]:
    """``env`` with every variable that names a file (CGX_PS_TOKEN_FILE, CGX_PS_TLS_*) moved
    under ``root``, the file holding ``files[basename]``: the pod's Secret mounts, locally."""
    env = dict(env)
    for var, path in env.items():
        if var == "CGX_PS_TOKEN_FILE" or (var.startswith("CGX_PS_TLS_") and var != "CGX_PS_TLS_SERVER_NAME"):
            local = root / path.lstrip("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(files[PurePosixPath(path).name])
            env[var] = str(local)
    return env


@pytest.fixture
def tls_health_server(pki):
    """A gRPC health server with the shard certificate, requiring client certificates."""
    import grpc
    from concurrent import futures
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    shard = pki["shard"]
    creds = grpc.ssl_server_credentials([(shard["tls.key"], shard["tls.crt"])], root_certificates=shard["ca.crt"],
                                        require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_wait_for_shards_speaks_mtls_like_the_workers(tls_health_server, pki, tmp_path):
    """The init container's TLS environment (cpu-local-tls) reaches a shard that requires
    client certificates; without the client certificate, or checking the dialled name
    instead of CGX_PS_TLS_SERVER_NAME, it does not."""
    rel = "overlays/cpu-local-tls"
    init = container(worker_job(rel), "wait-for-shards", init=True)
    env = materialize(container_env(rel, init, DOWNWARD), tmp_path / "pod", pki["worker"])
    env["CGX_PS_SERVERS"] = tls_health_server
    env.pop("CGX_PS_NUM_SHARDS")
    assert wfs.run_wait_for_shards(init_args(init, "--timeout", "10", "--interval", "0.2"), env=env) == 0

    quiet = dict(timeout=0.6, interval=0.2, rpc_timeout=0.5, log=lambda s: None)
    security = ChannelSecurity.from_env(env)
    assert wfs.wait([tls_health_server], security=security, **quiet)
    no_client_cert = ChannelSecurity(tls_ca=env["CGX_PS_TLS_CA"], server_name=env["CGX_PS_TLS_SERVER_NAME"])
    assert not wfs.wait([tls_health_server], security=no_client_cert, **quiet)
    assert not wfs.wait([tls_health_server], **quiet)                       # plaintext
    # The dialled name is not in the certificate, and gRPC refuses a "*.cgx-ps-shard" wildcard
    # (one label after the star): hence CGX_PS_TLS_SERVER_NAME.
    for name in ("cgx-ps-shard-0.cgx-ps-shard", "cgx-ps-shard.other"):
        other = ChannelSecurity.from_env({**env, "CGX_PS_TLS_SERVER_NAME": name})
        assert not wfs.wait([tls_health_server], security=other, **quiet), name
    assert not grpc_name_matches("cgx-ps-shard-0.cgx-ps-shard", ["*.cgx-ps-shard"])
    assert grpc_name_matches("cgx-ps-shard-0.cgx-ps-shard.ns.svc", ["*.cgx-ps-shard.ns.svc"])
    # A half-configured client certificate is a configuration error (exit 2), by name.
    assert wait_main({**env, "CGX_PS_TLS_KEY": ""}, "--timeout", "1") == 2
    assert wait_main({**env, "CGX_PS_TLS_CA": str(tmp_path / "missing.crt")}, "--timeout", "1") == 2


# ---------------------------------------------------------------------------------------
# the real shard, started the way the StatefulSet starts it (on loopback)


@contextlib.contextmanager
def real_shard(tmp_path: Path, rel: str, files: dict[str, bytes]):
    """The shard of ``rel`` started with its manifest's command and environment, on loopback
    and free ports (this runs on a shared machine), with its Secret files from ``files``.
    Yields (process, bound ports, environment, StatefulSet)."""
    try:
        import cgx_ps.server.main  # noqa: F401
    except Exception as exc:  # the server is developed alongside; its own tests cover it
        pytest.skip(f"cgx_ps.server does not import: {exc!r}")
    sts = shard_sts(rel)
    c = container(sts, "shard")
    env = materialize(container_env(rel, c, {SHARD_INDEX_FIELD: "0"}), tmp_path / "pod", files)
    args = expanded_args(c, env)
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = "0"
    args[args.index("--metrics-port") + 1] = "0"
    if "CGX_PS_HEALTH_PORT" in env:
        env["CGX_PS_HEALTH_PORT"] = "0"
    port_file = tmp_path / "ports.json"
    proc_env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_PS_")}
    proc_env.update(env)
    # a cache of its own, as the manifest gives the pod, shared by these tests: one cold compile
    proc_env["NUMBA_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / "cgx-ps-test-numba-cache")
    assert args[0] == "server", args
    proc = launch_shard(args[1:], port_file, env=proc_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        try:
            # its own NUMBA_CACHE_DIR, as the manifest sets: the shard compiles its kernels cold
            info = wait_for_port_file(proc, port_file, time.monotonic() + STARTUP_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as exc:
            proc.kill()  # reading a live shard's output would wait for it forever
            raise AssertionError(f"shard {exc}: {proc.communicate()[0]}") from None
        yield proc, info, env, sts
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop_within_grace(proc, env, sts):
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    grace = pod_spec(sts)["terminationGracePeriodSeconds"]
    assert proc.wait(timeout=grace) == 0
    assert time.monotonic() - t0 < float(env["CGX_PS_DRAIN_TIMEOUT"]) + 5


TEST_TOKEN = b"0123456789abcdef0123456789abcdef\n"   # as `openssl rand -hex 16 > token` writes it


def test_real_shard_with_the_manifest_environment(tmp_path):
    """Health SERVING, the metrics the docs describe, and a clean exit 0 on SIGTERM well
    within terminationGracePeriodSeconds."""
    with real_shard(tmp_path, "overlays/cpu-local", {TOKEN_KEY: TEST_TOKEN}) as (proc, ports, env, sts):
        assert wfs.wait([f"127.0.0.1:{ports['port']}"], timeout=20, interval=0.2, log=lambda s: None)
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics_port']}/metrics", timeout=10) as r:
            text = r.read().decode()
        docs = (REPO / "docs" / "deploy.md").read_text()
        for metric in ("cgx_ps_bytes_in_total", "cgx_ps_rounds_total", "cgx_ps_round_latency_seconds",
                       "cgx_ps_last_node_wait_seconds", "cgx_ps_compression_ratio",
                       "cgx_ps_connected_nodes"):
            assert metric in text, f"{metric} not exported"
            assert metric in docs, f"{metric} not described in docs/deploy.md"
        stop_within_grace(proc, env, sts)


def test_real_shard_with_the_tls_manifest_environment(tmp_path, pki):
    """cpu-local-tls: the kubelet's view (plaintext gRPC health on the health port) and the
    workers' (mutual TLS on the gRPC port, with the init container's environment)."""
    files = {TOKEN_KEY: TEST_TOKEN, **pki["shard"]}
    rel = "overlays/cpu-local-tls"
    with real_shard(tmp_path, rel, files) as (proc, ports, env, sts):
        assert ports.get("health_port", -1) > 0, f"no health port bound: {ports}"
        quiet = dict(interval=0.2, rpc_timeout=1, log=lambda s: None)
        assert wfs.wait([f"127.0.0.1:{ports['health_port']}"], timeout=20, **quiet)   # the probes
        init = container(worker_job(rel), "wait-for-shards", init=True)
        worker_env = materialize(container_env(rel, init, DOWNWARD), tmp_path / "worker", pki["worker"])
        grpc_address = f"127.0.0.1:{ports['port']}"
        assert wfs.wait([grpc_address], timeout=20, security=ChannelSecurity.from_env(worker_env), **quiet)
        assert not wfs.wait([grpc_address], timeout=1, **quiet)   # no plaintext on the gRPC port
        no_client_cert = ChannelSecurity(tls_ca=worker_env["CGX_PS_TLS_CA"],
                                             server_name=worker_env["CGX_PS_TLS_SERVER_NAME"])
        assert not wfs.wait([grpc_address], timeout=1, security=no_client_cert, **quiet)
        stop_within_grace(proc, env, sts)
