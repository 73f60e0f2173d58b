"""The kubelet's view of a container: its environment (envFrom, then env in order) with $(VAR)
expansion, its arguments, resource quantities, and which Secret a file it sees comes from; and,
for tests that run the commands locally, the pod's Secret files and the init container's
arguments."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from .dockerfiles import dockerfile_entrypoint
from .manifests import DEPLOY, objects, pod_spec


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


def parse_quantity(q) -> float:
    """A Kubernetes quantity in base units (bytes, cores)."""
    s = str(q)
    suffixes = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6,
                "G": 1e9, "T": 1e12, "m": 1e-3}
    for suffix, factor in suffixes.items():
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * factor
    return float(s)


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


def init_args(init: dict, *extra: str):
    """The init container's arguments (the image's entrypoint is the cgx-ps CLI), parsed by
    the real CLI, with ``extra`` appended."""
    from cgx_ps import cli

    argv = dockerfile_entrypoint(DEPLOY / "Dockerfile") + list(init["args"]) + list(extra)
    assert argv[0] == "cgx-ps"
    return cli.build_parser().parse_args(argv[1:])


def shard_command(rel: str, shard_index: str = "1"):
    """The shard container of ``rel`` as its pod runs it: (its arguments parsed by the real CLI,
    its environment, the ServerConfig ``cgx-ps server`` builds from them). The CLI reads its
    defaults from the environment when its parser is built, so the parse sees the pod's
    environment and nothing of this process's; building the config raises where the shard would
    refuse to start (--data-port with --tls-cert, say)."""
    import os

    import pytest

    from cgx_ps import cli
    from cgx_ps.server.config import ServerConfig

    from .manifests import SHARD_INDEX_FIELD, container, shard_sts

    c = container(shard_sts(rel), "shard")
    env = container_env(rel, c, {SHARD_INDEX_FIELD: shard_index})
    argv = (c.get("command") or dockerfile_entrypoint(DEPLOY / "Dockerfile")) + expanded_args(c, env)
    assert argv[0] == "cgx-ps"
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("CGX_PS_")]:
            mp.delenv(key)
        for key, value in env.items():
            mp.setenv(key, value)
        args = cli.build_parser().parse_args(argv[1:])
    return args, env, ServerConfig.from_flags(vars(args))
