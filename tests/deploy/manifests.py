"""deploy/ rendered with the real kustomize, and the objects of a render: the overlays, the
names every test shares, and lookups (the shard StatefulSet, the worker Job, a container).

Importing it skips the importing test module without kubernetes-validate, as test_deploy.py
did for all of these tests."""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

pytest.importorskip("kubernetes_validate")  # as before the split: no deploy test runs without it

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.parent.name for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
RENDER_DIRS = ["base", *(f"overlays/{o}" for o in OVERLAYS)]
TLS_COMPONENT = "optional/tls"
DATA_PLANE_COMPONENT = "optional/data-plane"

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
# the renders with the raw data plane on (optional/data-plane); off in every other one
DATA_PLANE_DIRS = [rel for rel in RENDER_DIRS if uses_component(rel, DATA_PLANE_COMPONENT)]


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


def pod_spec(pod_owner: dict) -> dict:
    return pod_owner["spec"]["template"]["spec"]


def is_custom_resource(obj: dict) -> bool:
    return obj["apiVersion"].split("/")[0] in CUSTOM_GROUPS


# what the downward API gives the first pod of each workload
DOWNWARD = {SHARD_INDEX_FIELD: "0", NODE_RANK_FIELD: "0", JOB_ID_FIELD: "3f2c-uid"}
