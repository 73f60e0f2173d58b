"""The images' Dockerfiles: their instructions and entrypoint, and image references."""

from __future__ import annotations

import json
import re
from pathlib import Path


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


def split_image(ref: str) -> tuple[str, str | None, str | None]:
    """An image reference as (name, tag, digest)."""
    name, _, digest = ref.partition("@")
    slash, colon = name.rfind("/"), name.rfind(":")
    if colon > slash:
        return name[:colon], name[colon + 1:], digest or None
    return name, None, digest or None
