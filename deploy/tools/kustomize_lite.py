#!/usr/bin/env python3
"""A small, strict subset of kustomize: enough to render deploy/ without a kustomize binary.

    python deploy/tools/kustomize_lite.py deploy/overlays/cpu-local     # YAML on stdout

This is test support (tests/test_deploy.py renders every overlay with it where neither
`kubectl kustomize` nor `kustomize` is installed, and compares it with the real thing where
one is). It is not a kustomize replacement: it implements the features deploy/ uses, the
way kustomize v5 behaves for them, and raises UnsupportedError for anything else rather
than guessing. Supported kustomization fields:

    resources           files (multi-document YAML) and directories (nested kustomizations)
    namespace           sets metadata.namespace; renames Namespace objects, as kustomize does
    labels              pairs, includeSelectors, includeTemplates
    commonLabels        (= labels with includeSelectors: true)
    configMapGenerator  literals only; behavior create/merge/replace; the content-hash name
                        suffix (on by default; options.disableNameSuffixHash or
                        generatorOptions.disableNameSuffixHash turn it off), with the
                        references in pod specs renamed to match
    patches             strategic-merge patches (path or inline), optionally with a target
    images              name -> newName / newTag / digest
    replacements        inline; source and target selection by kind/name/namespace/group/
                        version; fieldPaths with `a.b`, `[key=value]`, `[dotted.key]` and
                        list indices

Deliberately stricter than kustomize in one place: a replacement whose target field does
not exist is an error here (kustomize skips it silently, hiding a typo in a fieldPath).
Transformers run in kustomize's order: patches, namespace, labels, images, replacements.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

__all__ = ["render", "UnsupportedError", "RenderError", "dump"]


class RenderError(Exception):
    """The kustomization is wrong (kustomize would reject it too)."""


class UnsupportedError(RenderError):
    """The kustomization uses a feature this renderer does not implement."""


KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {
    "apiVersion", "kind", "resources", "namespace", "labels", "commonLabels",
    "configMapGenerator", "generatorOptions", "patches", "images", "replacements",
}


@dataclass
class Res:
    obj: dict
    # Generated ConfigMaps keep their plain name until render() appends the hash.
    generated: bool = False
    hash_suffix: bool = False
    origin: str = ""

    @property
    def kind(self) -> str:
        return self.obj.get("kind", "")

    @property
    def name(self) -> str:
        return self.obj.get("metadata", {}).get("name", "")

    @property
    def namespace(self) -> str | None:
        return self.obj.get("metadata", {}).get("namespace")

    @property
    def group_version(self) -> tuple[str, str]:
        api = self.obj.get("apiVersion", "")
        if "/" in api:
            g, v = api.split("/", 1)
            return g, v
        return "", api

    def ident(self) -> tuple[str, str, str, str]:
        return (self.group_version[0], self.kind, self.namespace or "", self.name)


# ---------------------------------------------------------------------------------------
# loading


def _load_yaml_docs(path: Path) -> list[dict]:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "apiVersion" not in d:
            raise RenderError(f"{path}: every document must be a Kubernetes object")
        if d["kind"].endswith("List") and "items" in d:
            raise UnsupportedError(f"{path}: List objects are not supported")
    return docs


def _kustomization_file(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        p = directory / name
        if p.is_file():
            return p
    raise RenderError(f"{directory}: no kustomization file")


def _within(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------
# configMapGenerator


def _go_json(obj: Any) -> str:
    """json.Marshal's output for maps of strings: sorted keys, no spaces, HTML escaped."""
    s = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return (s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
             .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def configmap_hash(cm: dict) -> str:
    """kustomize's ConfigMap name suffix (api/hasher): sha256 over kind, name and data.

    kustomize looks the name up with the one-segment path "metadata/name", which never
    matches, so the name it hashes is always "" -- reproduced here on purpose.
    """
    m: dict[str, Any] = {"kind": "ConfigMap", "name": "", "data": cm.get("data") or {}}
    if cm.get("binaryData"):
        m["binaryData"] = cm["binaryData"]
    hexdigest = hashlib.sha256(_go_json(m).encode()).hexdigest()
    return hexdigest[:10].translate(str.maketrans("013ae", "ghkmt"))


def _parse_literal(literal: str) -> tuple[str, str]:
    if "=" not in literal:
        raise RenderError(f"configMapGenerator literal {literal!r} is not KEY=VALUE")
    key, value = literal.split("=", 1)
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    if not key:
        raise RenderError(f"configMapGenerator literal {literal!r} has an empty key")
    return key, value


def _generate_configmaps(spec: list, gen_opts: dict, namespace: str | None,
                         resources: list[Res], where: Path) -> None:
    for g in spec or []:
        unknown = set(g) - {"name", "namespace", "behavior", "literals", "options"}
        if unknown:
            raise UnsupportedError(f"{where}: configMapGenerator fields {sorted(unknown)}")
        options = dict(gen_opts or {})
        options.update(g.get("options") or {})
        unknown = set(options) - {"disableNameSuffixHash"}
        if unknown:
            raise UnsupportedError(f"{where}: generator options {sorted(unknown)}")
        name = g["name"]
        data: dict[str, str] = {}
        for literal in g.get("literals") or []:
            k, v = _parse_literal(str(literal))
            if k in data:
                raise RenderError(f"{where}: configMapGenerator {name}: duplicate key {k}")
            data[k] = v
        behavior = g.get("behavior", "create")
        hashed = not options.get("disableNameSuffixHash", False)
        ns = g.get("namespace", namespace)
        if behavior == "create":
            obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
                   "data": data}
            if ns:
                obj["metadata"]["namespace"] = ns
            resources.append(Res(obj, generated=True, hash_suffix=hashed, origin=str(where)))
        elif behavior in ("merge", "replace"):
            matches = [r for r in resources if r.kind == "ConfigMap" and r.name == name
                       and (ns is None or (r.namespace or None) in (None, ns))]
            if len(matches) != 1:
                raise RenderError(f"{where}: configMapGenerator {name}: behavior {behavior} "
                                  f"needs exactly one existing ConfigMap, found {len(matches)}")
            target = matches[0]
            if behavior == "merge":
                target.obj.setdefault("data", {}).update(data)
            else:
                target.obj["data"] = data
            if "disableNameSuffixHash" in (g.get("options") or {}):
                target.hash_suffix = hashed
        else:
            raise RenderError(f"{where}: unknown configMapGenerator behavior {behavior!r}")


# ---------------------------------------------------------------------------------------
# strategic merge patches (the list merge keys of the core/apps/batch types)

# list field -> merge key; lists not named here are replaced whole, as for atomic lists.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "resourceClaims": "name",
}


def _list_merge_key(field_name: str, items: list) -> str | None:
    if field_name == "ports":
        # ContainerPort merges on containerPort, ServicePort on port.
        probe = next((i for i in items if isinstance(i, dict)), {})
        return "containerPort" if "containerPort" in probe else "port"
    return _MERGE_KEYS.get(field_name)


def _smp_merge(base: Any, patch: Any, field_name: str = "") -> Any:
    if isinstance(patch, dict):
        directive = patch.get("$patch")
        if directive == "replace":
            return {k: v for k, v in patch.items() if k != "$patch"}
        if directive == "delete":
            return None
        if any(isinstance(k, str) and k.startswith("$") for k in patch):
            raise UnsupportedError(f"patch directive in {sorted(k for k in patch if k.startswith('$'))}")
        if not isinstance(base, dict):
            base = {}
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                merged = _smp_merge(out[k], v, k)
                if merged is None:
                    out.pop(k, None)
                else:
                    out[k] = merged
            else:
                merged = _smp_merge(None, v, k)
                if merged is not None:
                    out[k] = merged
        return out
    if isinstance(patch, list):
        key = _list_merge_key(field_name, patch + (base if isinstance(base, list) else []))
        if key is None or not isinstance(base, list):
            return [_strip_directives(i) for i in patch]
        # Like kustomize (kyaml): the patch's items first, in the patch's order (merged with
        # their base item where there is one), then the base items the patch does not name.
        out = []
        named = set()
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise UnsupportedError(f"list {field_name}: patch item without merge key {key}")
            named.add(item[key])
            if item.get("$patch") == "delete":
                continue
            match = next((b for b in base if isinstance(b, dict) and b.get(key) == item[key]), None)
            out.append(_strip_directives(item) if match is None else _smp_merge(match, item, field_name))
        out += [copy.deepcopy(b) for b in base if not (isinstance(b, dict) and b.get(key) in named)]
        return out
    return copy.deepcopy(patch)


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        if any(isinstance(k, str) and k.startswith("$") for k in value):
            raise UnsupportedError("patch directives on new list items")
        return {k: _strip_directives(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def _selector_matches(sel: dict, r: Res) -> bool:
    unknown = set(sel) - {"kind", "name", "namespace", "group", "version"}
    if unknown:
        raise UnsupportedError(f"selector fields {sorted(unknown)}")
    g, v = r.group_version
    checks = {"kind": r.kind, "name": r.name, "namespace": r.namespace or "", "group": g, "version": v}
    for k, want in sel.items():
        if k in ("kind", "name", "namespace"):
            if not re.fullmatch(str(want), checks[k]):
                return False
        elif str(want) != checks[k]:
            return False
    return True


def _apply_patches(patches: list, resources: list[Res], directory: Path, root: Path) -> None:
    for p in patches or []:
        unknown = set(p) - {"path", "patch", "target", "options"}
        if unknown or p.get("options"):
            raise UnsupportedError(f"{directory}: patch fields {sorted(unknown | set(p.get('options') or {}))}")
        if "path" in p:
            file = directory / p["path"]
            if not _within(file, root):
                raise RenderError(f"{file}: outside the kustomization root")
            text = file.read_text()
        else:
            text = p["patch"]
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
        if len(docs) != 1 or not isinstance(docs[0], dict):
            raise UnsupportedError(f"{directory}: only single-document strategic-merge patches "
                                   "are supported (no JSON 6902, no multi-document patches)")
        patch = docs[0]
        if "target" in p:
            targets = [r for r in resources if _selector_matches(p["target"], r)]
        else:
            pr = Res(patch)
            targets = [r for r in resources if r.kind == pr.kind and r.name == pr.name
                       and r.group_version[0] == pr.group_version[0]]
        if not targets:
            raise RenderError(f"{directory}: patch {p.get('path', '<inline>')} matches no resource")
        for r in targets:
            body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
            if "target" in p:
                body.get("metadata", {}).pop("name", None)
            merged = _smp_merge(r.obj, body)
            merged["apiVersion"], merged["kind"] = r.obj["apiVersion"], r.obj["kind"]
            r.obj.clear()
            r.obj.update(merged)


# ---------------------------------------------------------------------------------------
# field specs (namespace, labels, images, name references)

_CLUSTER_SCOPED = {
    "Namespace", "Node", "PersistentVolume", "StorageClass", "CustomResourceDefinition",
    "ClusterRole", "ClusterRoleBinding", "PriorityClass", "IngressClass", "RuntimeClass",
    "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration", "APIService",
    "CSIDriver", "CSINode", "VolumeAttachment",
}

# (path, kind, group or None, create) -- kustomize's builtin field specs, as far as used.
_TEMPLATE_LABEL_SPECS = [
    ("spec/template/metadata/labels", "ReplicationController", "", True),
    ("spec/template/metadata/labels", "Deployment", None, True),
    ("spec/template/metadata/labels", "ReplicaSet", None, True),
    ("spec/template/metadata/labels", "DaemonSet", None, True),
    ("spec/template/metadata/labels", "StatefulSet", "apps", True),
    ("spec/volumeClaimTemplates[]/metadata/labels", "StatefulSet", "apps", True),
    ("spec/template/metadata/labels", "Job", "batch", True),
    ("spec/jobTemplate/metadata/labels", "CronJob", "batch", True),
    ("spec/jobTemplate/spec/template/metadata/labels", "CronJob", "batch", True),
]
_AFFINITY = [
    "spec/template/spec/affinity/podAffinity/preferredDuringSchedulingIgnoredDuringExecution/podAffinityTerm/labelSelector/matchLabels",
    "spec/template/spec/affinity/podAffinity/requiredDuringSchedulingIgnoredDuringExecution/labelSelector/matchLabels",
    "spec/template/spec/affinity/podAntiAffinity/preferredDuringSchedulingIgnoredDuringExecution/podAffinityTerm/labelSelector/matchLabels",
    "spec/template/spec/affinity/podAntiAffinity/requiredDuringSchedulingIgnoredDuringExecution/labelSelector/matchLabels",
    "spec/template/spec/topologySpreadConstraints/labelSelector/matchLabels",
]
_SELECTOR_LABEL_SPECS = [
    ("spec/selector", "Service", "", True),
    ("spec/selector", "ReplicationController", "", True),
    ("spec/selector/matchLabels", "Deployment", None, True),
    *[(p, "Deployment", "apps", False) for p in _AFFINITY],
    ("spec/selector/matchLabels", "ReplicaSet", None, True),
    ("spec/selector/matchLabels", "DaemonSet", None, True),
    ("spec/selector/matchLabels", "StatefulSet", "apps", True),
    *[(p, "StatefulSet", "apps", False) for p in _AFFINITY],
    ("spec/selector/matchLabels", "Job", "batch", False),
    ("spec/jobTemplate/spec/selector/matchLabels", "CronJob", "batch", False),
    ("spec/selector/matchLabels", "PodDisruptionBudget", "policy", False),
    ("spec/podSelector/matchLabels", "NetworkPolicy", "networking.k8s.io", False),
    ("spec/ingress/from/podSelector/matchLabels", "NetworkPolicy", "networking.k8s.io", False),
    ("spec/egress/to/podSelector/matchLabels", "NetworkPolicy", "networking.k8s.io", False),
]


def _spec_applies(r: Res, kind: str, group: str | None) -> bool:
    return r.kind == kind and (group is None or r.group_version[0] == group)


def _walk_to_maps(node: Any, segments: list[str], create: bool) -> Iterable[dict]:
    """Yield the maps at ``segments`` below ``node``; lists are traversed implicitly."""
    if isinstance(node, list):
        for item in node:
            yield from _walk_to_maps(item, segments, create)
        return
    if not isinstance(node, dict):
        return
    if not segments:
        yield node
        return
    head, rest = segments[0], segments[1:]
    is_list = head.endswith("[]")
    if is_list:
        head = head[:-2]
    if head not in node:
        if not create or is_list:   # kustomize never creates a list to label its items
            return
        node[head] = {}
    yield from _walk_to_maps(node[head], rest, create)


def _add_labels(r: Res, pairs: dict, include_selectors: bool, include_templates: bool) -> None:
    meta = r.obj.setdefault("metadata", {})
    meta.setdefault("labels", {}).update(pairs)
    specs = []
    if include_selectors or include_templates:
        specs += _TEMPLATE_LABEL_SPECS
    if include_selectors:
        specs += _SELECTOR_LABEL_SPECS
    for path, kind, group, create in specs:
        if _spec_applies(r, kind, group):
            for m in _walk_to_maps(r.obj, path.split("/"), create):
                m.update(pairs)


def _pod_specs(obj: dict) -> list[dict]:
    out = []
    spec = obj.get("spec") or {}
    if obj.get("kind") == "Pod":
        out.append(spec)
    tmpl = (spec.get("template") or {}).get("spec")
    if isinstance(tmpl, dict):
        out.append(tmpl)
    job_tmpl = (((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}).get("spec")
    if isinstance(job_tmpl, dict):
        out.append(job_tmpl)
    return out


def _split_image(image: str) -> tuple[str, str | None, str | None]:
    digest = None
    if "@" in image:
        image, digest = image.split("@", 1)
    tag = None
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        image, tag = image[:colon], image[colon + 1:]
    return image, tag, digest


def _apply_images(images: list, resources: list[Res], where: Path) -> None:
    for spec in images or []:
        unknown = set(spec) - {"name", "newName", "newTag", "digest"}
        if unknown:
            raise UnsupportedError(f"{where}: images fields {sorted(unknown)}")
        for r in resources:
            for pod in _pod_specs(r.obj):
                for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
                    name, tag, digest = _split_image(str(c.get("image", "")))
                    if name != spec["name"]:
                        continue
                    name = spec.get("newName", name)
                    if "digest" in spec:
                        c["image"] = f"{name}@{spec['digest']}"
                        continue
                    if "newTag" in spec:
                        tag, digest = str(spec["newTag"]), None
                    c["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def _apply_namespace(namespace: str, resources: list[Res]) -> None:
    for r in resources:
        if r.kind in ("RoleBinding", "ClusterRoleBinding"):
            raise UnsupportedError("namespace with RoleBindings (kustomize rewrites subjects)")
        if r.kind == "Namespace":
            r.obj["metadata"]["name"] = namespace
        elif r.kind not in _CLUSTER_SCOPED:
            r.obj.setdefault("metadata", {})["namespace"] = namespace


# ---------------------------------------------------------------------------------------
# replacements


def _split_field_path(path: str) -> list[str]:
    segments, buf, depth = [], "", 0
    for ch in path:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "." and depth == 0:
            segments.append(buf)
            buf = ""
        else:
            buf += ch
    segments.append(buf)
    if depth or any(s == "" for s in segments):
        raise RenderError(f"malformed fieldPath {path!r}")
    return segments


def _resolve(obj: Any, path: str) -> tuple[Any, Any]:
    """(parent container, key) of the field at ``path``; raises KeyError when missing."""
    segments = _split_field_path(path)
    node: Any = obj
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg.startswith("[") and seg.endswith("]"):
            inner = seg[1:-1]
            if "=" in inner:
                if not isinstance(node, list):
                    raise KeyError(path)
                k, v = inner.split("=", 1)
                idx = next((n for n, item in enumerate(node)
                            if isinstance(item, dict) and str(item.get(k)) == v), None)
                if idx is None:
                    raise KeyError(path)
                key: Any = idx
            else:
                key = inner       # a map key containing dots, e.g. [prometheus.io/port]
        elif isinstance(node, list):
            if not seg.isdigit():
                raise UnsupportedError(f"fieldPath segment {seg!r} on a list in {path!r}")
            key = int(seg)
        else:
            if seg == "*":
                raise UnsupportedError(f"wildcards in fieldPath {path!r}")
            key = seg
        if isinstance(node, list):
            if not isinstance(key, int) or key >= len(node):
                raise KeyError(path)
        elif not isinstance(node, dict) or key not in node:
            raise KeyError(path)
        if last:
            return node, key
        node = node[key]
    raise KeyError(path)


def _apply_replacements(replacements: list, resources: list[Res], where: Path) -> None:
    for rep in replacements or []:
        if "path" in rep:
            raise UnsupportedError(f"{where}: replacements from files")
        source = dict(rep["source"])
        fp = source.pop("fieldPath", "metadata.name")
        if source.pop("options", None):
            raise UnsupportedError(f"{where}: replacement source options")
        matches = [r for r in resources if _selector_matches(source, r)]
        if len(matches) != 1:
            raise RenderError(f"{where}: replacement source {rep['source']} matches "
                              f"{len(matches)} resources")
        try:
            parent, key = _resolve(matches[0].obj, fp)
        except KeyError:
            raise RenderError(f"{where}: replacement source field {fp} is missing") from None
        value = parent[key]
        if isinstance(value, (dict, list)):
            raise UnsupportedError(f"{where}: non-scalar replacement source {fp}")
        for target in rep["targets"]:
            options = target.get("options") or {}
            if any(options.values()):
                raise UnsupportedError(f"{where}: replacement target options {options}")
            selected = [r for r in resources if _selector_matches(target["select"], r)
                        and not any(_selector_matches(rej, r) for rej in target.get("reject") or [])]
            if not selected:
                raise RenderError(f"{where}: replacement target {target['select']} matches nothing")
            for r in selected:
                for path in target["fieldPaths"]:
                    try:
                        tparent, tkey = _resolve(r.obj, path)
                    except KeyError:
                        raise RenderError(f"{where}: replacement target {r.kind}/{r.name} has no "
                                          f"field {path} (kustomize would skip it silently)") from None
                    tparent[tkey] = _retype(value, tparent[tkey], path)


def _retype(value: Any, old: Any, path: str) -> Any:
    """kustomize copies the scalar text and keeps the target's YAML tag."""
    if isinstance(old, bool) or isinstance(value, bool):
        if isinstance(old, bool) and isinstance(value, bool):
            return value
        raise UnsupportedError(f"replacement into/from a boolean at {path}")
    if isinstance(old, int):
        try:
            return int(str(value))
        except ValueError:
            raise RenderError(f"replacement puts {value!r} into the integer field {path}") from None
    if isinstance(old, float):
        return float(str(value))
    if isinstance(old, str):
        return str(value)
    raise UnsupportedError(f"replacement into a {type(old).__name__} at {path}")


# ---------------------------------------------------------------------------------------
# name references (hash-suffixed ConfigMaps)


def _rename_configmap_refs(obj: dict, old: str, new: str) -> None:
    for pod in _pod_specs(obj):
        for c in (pod.get("containers") or []) + (pod.get("initContainers") or []) + \
                (pod.get("ephemeralContainers") or []):
            for ef in c.get("envFrom") or []:
                ref = ef.get("configMapRef")
                if ref and ref.get("name") == old:
                    ref["name"] = new
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
                if ref and ref.get("name") == old:
                    ref["name"] = new
        for v in pod.get("volumes") or []:
            if (v.get("configMap") or {}).get("name") == old:
                v["configMap"]["name"] = new
            for src in (v.get("projected") or {}).get("sources") or []:
                if (src.get("configMap") or {}).get("name") == old:
                    src["configMap"]["name"] = new


# ---------------------------------------------------------------------------------------
# the build


def _build(directory: Path, root: Path, stack: tuple[Path, ...]) -> list[Res]:
    directory = directory.resolve()
    if directory in stack:
        raise RenderError(f"{directory}: cycle in resources")
    kfile = _kustomization_file(directory)
    k = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(k) - SUPPORTED_FIELDS
    if unknown:
        raise UnsupportedError(f"{kfile}: fields {sorted(unknown)}")
    if k.get("kind", "Kustomization") != "Kustomization":
        raise UnsupportedError(f"{kfile}: kind {k.get('kind')}")

    resources: list[Res] = []
    for entry in k.get("resources") or []:
        path = (directory / entry)
        if "://" in entry or entry.startswith("git@"):
            raise UnsupportedError(f"{kfile}: remote resource {entry}")
        if path.is_dir():
            resources += _build(path, path, stack + (directory,))
        elif path.is_file():
            if not _within(path, directory):
                raise RenderError(f"{kfile}: file {entry} is outside the kustomization root")
            resources += [Res(d, origin=str(path)) for d in _load_yaml_docs(path)]
        else:
            raise RenderError(f"{kfile}: resource {entry} not found")

    namespace = k.get("namespace")
    _generate_configmaps(k.get("configMapGenerator"), k.get("generatorOptions") or {},
                         namespace, resources, kfile)

    seen: dict[tuple, str] = {}
    for r in resources:
        if r.ident() in seen:
            raise RenderError(f"{kfile}: duplicate resource {r.kind}/{r.name}")
        seen[r.ident()] = r.origin

    # transformers, in kustomize's builtin order
    _apply_patches(k.get("patches"), resources, directory, directory)
    if namespace:
        _apply_namespace(namespace, resources)
    if k.get("commonLabels"):
        for r in resources:
            _add_labels(r, dict(k["commonLabels"]), True, True)
    for spec in k.get("labels") or []:
        unknown = set(spec) - {"pairs", "includeSelectors", "includeTemplates"}
        if unknown:
            raise UnsupportedError(f"{kfile}: labels fields {sorted(unknown)}")
        for r in resources:
            _add_labels(r, dict(spec.get("pairs") or {}), bool(spec.get("includeSelectors")),
                        bool(spec.get("includeTemplates")))
    _apply_images(k.get("images"), resources, kfile)
    _apply_replacements(k.get("replacements"), resources, kfile)
    return resources


# kustomize's "legacy" output order
_ORDER_FIRST = [
    "Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition", "ServiceAccount",
    "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding",
    "ConfigMap", "Secret", "Endpoints", "Service", "LimitRange", "PriorityClass",
    "PersistentVolume", "PersistentVolumeClaim", "Deployment", "StatefulSet", "CronJob",
    "PodDisruptionBudget",
]
_ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]


def _order_key(obj: dict) -> tuple:
    kind = obj["kind"]
    if kind in _ORDER_FIRST:
        rank = _ORDER_FIRST.index(kind)
    elif kind in _ORDER_LAST:
        rank = len(_ORDER_FIRST) + 1 + _ORDER_LAST.index(kind)
    else:
        rank = len(_ORDER_FIRST)
    meta = obj.get("metadata", {})
    return (rank, obj["apiVersion"], kind, meta.get("namespace", ""), meta.get("name", ""))


def render(directory: str | Path) -> list[dict]:
    """The objects `kustomize build DIRECTORY` would print, as Python dicts."""
    directory = Path(directory)
    resources = _build(directory, directory, ())
    for r in resources:
        if r.kind == "ConfigMap" and r.generated and r.hash_suffix:
            old = r.name
            new = f"{old}-{configmap_hash(r.obj)}"
            r.obj["metadata"]["name"] = new
            for other in resources:
                if (other.namespace or "") == (r.namespace or ""):
                    _rename_configmap_refs(other.obj, old, new)
    return sorted((r.obj for r in resources), key=_order_key)


def dump(objects: list[dict]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=True, default_flow_style=False)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: kustomize_lite.py DIRECTORY", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(dump(render(args[0])))
    except RenderError as err:
        print(f"kustomize_lite: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
