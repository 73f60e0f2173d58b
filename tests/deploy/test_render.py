"""Every overlay renders with the real kustomize and validates strictly against the Kubernetes
schemas; the overlays' structure (replacements, components, namespaces, hashed names); labels,
selectors and Services agree; the optional ServiceMonitor matches the Service."""

from __future__ import annotations

import re

import pytest
import yaml

from .manifests import (CONFIG_NAME, DATA_PLANE_DIRS, DEPLOY, MIN_K8S, OVERLAYS, RENDER_DIRS, TLS_DIRS, TOKEN_SECRET,
                        container,
                        is_custom_resource, kustomization, objects, one, pod_spec, render, shard_sts, worker_job,
                        workloads)

kubernetes_validate = pytest.importorskip("kubernetes_validate")


def _id(obj: dict) -> tuple:
    return obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]


@pytest.mark.parametrize("rel", RENDER_DIRS)
def test_renders(rel):
    objs = render(rel)
    kinds = sorted(o["kind"] for o in objs)
    for kind in ("ConfigMap", "Job", "NetworkPolicy", "PodDisruptionBudget", "Service", "StatefulSet"):
        assert kind in kinds, f"{rel}: no {kind}"
    assert len({_id(o) for o in objs}) == len(objs)


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
    assert {"cpu-local", "cpu-local-tls", "cpu-local-data-plane", "gpu"} <= set(OVERLAYS)
    assert "overlays/cpu-local-tls" in TLS_DIRS
    assert DATA_PLANE_DIRS == ["overlays/cpu-local-data-plane"]  # the plane is opt-in, and plaintext


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
