"""Security: the bearer token Secret is mounted read-only into every pod that talks gRPC,
cpu-local generates it from an ignored file, and no secret material is committed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from .kubelet import container_env, readable_only_by_the_pod_user, secret_file
from .manifests import (DEPLOY, DOWNWARD, RENDER_DIRS, REPO, TOKEN_KEY, TOKEN_SECRET, container, objects, one,
                        secret_generator_inputs, shard_sts, worker_job)


def talking_containers(rel: str) -> list[tuple[dict, dict]]:
    """(pod owner, container) for every container that calls or serves ParameterServer RPCs."""
    return [(shard_sts(rel), container(shard_sts(rel), "shard")),
            (worker_job(rel), container(worker_job(rel), "worker"))]


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
