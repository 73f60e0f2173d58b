"""The images: pinned base images, a non-root user, the build context, CuPy only in the GPU
image, and exact pins for every dependency."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .dockerfiles import dockerfile_instructions, split_image
from .manifests import DEPLOY, REPO


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
