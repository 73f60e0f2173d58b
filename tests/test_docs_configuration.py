"""docs/configuration.md against the code's own tables, so that the page cannot drift from the code.

The code's settings: the shard's table (cgx_ps.server.config.SETTINGS: each flag, variable and default), the
worker's numeric variables (cgx_ps.worker.config.SETTINGS), every ``CGX_PS_*`` name in a string literal under
cgx_ps/ (the worker reads most of its variables where it uses them) and every ``--flag`` an ``add_argument`` call
under cgx_ps/ defines. A setting added to the code without the page, or a page row for a setting the code no
longer has, fails here. The last test checks every relative link of the project's Markdown.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from cgx_ps.envparse import plain_number
from cgx_ps.server.config import SETTINGS as SHARD_SETTINGS, flag_defaults
from cgx_ps.worker.config import SETTINGS as WORKER_VARIABLES

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
PACKAGE = ROOT / "cgx_ps"

# A complete variable name: "CGX_PS_TLS_*" names a family, not a variable, and is left out.
VARIABLE = re.compile(r"(?<![A-Za-z0-9_])CGX_PS_[A-Z0-9_]+(?![A-Za-z0-9_])")
CODE_SPAN = re.compile(r"`([^`]+)`")
FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def _variables(text: str) -> set[str]:
    return {name for name in VARIABLE.findall(text) if not name.endswith("_")}


def _sources() -> list[tuple[Path, ast.Module]]:
    paths = sorted(p for p in PACKAGE.rglob("*.py") if "v1" not in p.relative_to(PACKAGE).parts)  # generated stubs
    return [(p, ast.parse(p.read_text(), str(p))) for p in paths]


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes: prose about a variable is not the code reading it."""
    owners = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return {id(o.body[0].value) for o in owners
            if o.body and isinstance(o.body[0], ast.Expr) and isinstance(o.body[0].value, ast.Constant)}


def code_variables() -> set[str]:
    """Every CGX_PS_* name in a string literal (docstrings aside) under cgx_ps/, and the shard's table."""
    names = {s.env for s in SHARD_SETTINGS.values()}
    for _, tree in _sources():
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                names |= _variables(node.value)
    return names


def code_flags() -> set[str]:
    """Every --flag of the shard's table and of an add_argument call under cgx_ps/."""
    flags = {s.flag for s in SHARD_SETTINGS.values()}
    for _, tree in _sources():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
                    and node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("--")):
                flags.add(node.args[0].value)
    return flags


def page_text() -> str:
    return PAGE.read_text()


def page_rows() -> list[list[str]]:
    """The cells of every table row on the page, separator rows aside."""
    rows = []
    for line in page_text().splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def page_flags() -> set[str]:
    """The flags the page names: every code span that starts with one (`--watch [SECONDS]` names --watch)."""
    return {FLAG.match(span).group(0) for span in CODE_SPAN.findall(page_text()) if FLAG.match(span)}


def page_code_spans() -> set[str]:
    return {part.strip() for span in CODE_SPAN.findall(page_text()) for part in span.split(",")}


def test_the_scans_find_the_settings_they_are_for():
    # a scan that found nothing would pass the tests below without checking anything
    assert {"CGX_PS_SERVERS", "CGX_PS_DATAPLANE", "CGX_PS_WORKER_METRICS_PORT", "CGX_PS_TIMELINE"} <= code_variables()
    assert {"--data-port", "--port-file", "--data-base-port", "--watch", "--checkpoint", "--calibrate"} <= code_flags()
    assert "CGX_PS_TLS_" not in code_variables() and len(page_rows()) > 60


@pytest.mark.parametrize("name", sorted(SHARD_SETTINGS))
def test_every_shard_setting_is_a_row_with_its_flag_variable_and_default(name):
    setting = SHARD_SETTINGS[name]
    rows = [r for r in page_rows() if r[:2] == [f"`{setting.flag}`", f"`{setting.env}`"]]
    assert len(rows) == 1, f"docs/configuration.md needs one row | `{setting.flag}` | `{setting.env}` | default | meaning |"
    default, meaning = rows[0][2], rows[0][3]
    assert default and len(meaning) > 10, rows[0]
    if setting.deployed is not None:
        return  # a deployed shard's own default (the metrics port: 9400 + its index), said in words
    value = flag_defaults({})[name]
    if setting.kind is bool:
        expected = "on" if value else "off"
    elif value in ("", None):
        return  # no value: the row says what that means ("none", "all", "the --host address")
    elif setting.kind is str:
        expected = f"`{value}`"
    else:
        expected = plain_number(value)
    assert default.startswith(expected), f"{setting.flag}: the page says {default!r}, the code's default is {expected}"


def test_every_variable_the_code_reads_is_on_the_page():
    missing = sorted(code_variables() - _variables(page_text()))
    assert not missing, f"variables the code reads that docs/configuration.md does not name: {missing}"
    spans = page_code_spans()
    missing = sorted(v for v in WORKER_VARIABLES if v not in spans and not any(v in s.split() for s in spans))
    assert not missing, f"worker variables (cgx_ps.worker.config.SETTINGS) not on the page: {missing}"


def test_every_flag_the_code_defines_is_on_the_page():
    missing = sorted(code_flags() - page_flags())
    assert not missing, f"flags the code defines that docs/configuration.md does not name: {missing}"


def test_the_page_names_no_setting_the_code_lacks():
    unknown = sorted(_variables(page_text()) - code_variables())
    assert not unknown, f"docs/configuration.md names variables the code does not read: {unknown}"
    unknown = sorted(page_flags() - code_flags())
    assert not unknown, f"docs/configuration.md names flags no command defines: {unknown}"


# --- every relative link in the project's Markdown resolves ----------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _markdown_files() -> list[Path]:
    skip = {".git", ".venv", "node_modules"}
    return sorted(p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts))


def _prose(text: str) -> str:
    """The text outside fenced code blocks and code spans (a link in an example is not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of ``path``: lower case, punctuation dropped, spaces to hyphens."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_relative_link_in_the_markdown_resolves():
    broken = []
    for doc in _markdown_files():
        for target in LINK.findall(_prose(doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path_part, _, anchor = target.partition("#")
            dest = (doc.parent / path_part).resolve() if path_part else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
