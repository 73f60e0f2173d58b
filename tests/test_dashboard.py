"""The Grafana dashboard (deploy/optional/grafana) queries only metrics the code exports.

The names come from the prometheus_client registries of a real ShardServer and of the worker
exporter, not from a list kept by hand, so renaming a metric without the dashboard fails here.
Rendering the component is tested with the other manifests in tests/deploy/test_network.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cgx_ps.server import ServerConfig, ShardServer
from cgx_ps.worker.metrics import WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "optional" / "grafana" / "cgx-ps-dashboard.json"

# What the issue asks the dashboard to show, by the metric that shows it.
REQUIRED = {
    "rounds/s": "cgx_ps_rounds_total",
    "bytes in": "cgx_ps_bytes_in_total",
    "bytes out": "cgx_ps_bytes_out_total",
    "compression ratio": "cgx_ps_compression_ratio",
    "in-flight bytes": "cgx_ps_inflight_bytes",
    "in-flight cap": "cgx_ps_max_inflight_bytes",
    "round latency histogram": "cgx_ps_round_latency_seconds_bucket",
    "refused pushes": "cgx_ps_pushes_total",
    "sessions": "cgx_ps_session_state",
    "streams by plane (raw data plane or gRPC)": "cgx_ps_exchange_streams",
    "worker step time": "cgx_ps_worker_step_seconds_bucket",
    "exposed communication": "cgx_ps_worker_exposed_comm_seconds_sum",
    "bytes pushed": "cgx_ps_worker_bytes_pushed_total",
    "worker compression": "cgx_ps_worker_compressed",
    "adaptive bits": "cgx_ps_worker_tensor_bits",
    "auto decisions": "cgx_ps_worker_auto_decisions_total",
}

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "inf", "nan", "Inf", "NaN"}
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "unknown": ("",), "info": ("_info",)}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings, label
    matchers, ranges and grouping clauses are removed, that are not called (functions,
    aggregations) and not operators."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w$.])[a-zA-Z_:][a-zA-Z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0) in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def test_metric_names_parser():
    expr = ('histogram_quantile(0.99, sum by (le, shard) (rate(cgx_ps_round_latency_seconds_bucket'
            '{shard=~"$shard", x="a{b}"}[$__rate_interval]))) / on(shard) group_left max(up) > bool 0')
    assert metric_names(expr) == {"cgx_ps_round_latency_seconds_bucket", "up"}
    assert metric_names("sum(rate(a_total[5m])) / sum without (rank) (b)") == {"a_total", "b"}


def queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard's panels (rows included) and variables."""
    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", query)
            out.append(m[1] if m else query)
    return out


def exported_names() -> set[str]:
    """Every series name a real shard and the worker exporter can expose (families without
    samples yet, such as labelled ones, count by their type's suffixes)."""
    shard = ShardServer(ServerConfig(host="127.0.0.1", port=0, metrics_port=-1, kernel_threads=1))
    try:
        registries = [shard.metrics.registry, WorkerMetrics(rank=0).registry]
        names = set()
        for registry in registries:
            for family in registry.collect():
                names |= {family.name + s for s in _SUFFIXES[family.type]}
                names |= {s.name for s in family.samples}
        return names
    finally:
        shard.status.close()
        shard.executor.shutdown()


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_queries_only_exported_metrics(dashboard):
    exported = exported_names()
    asked = {name: expr for expr in queries(dashboard) for name in metric_names(expr)}
    unknown = {name: expr for name, expr in asked.items() if name not in exported}
    assert not unknown, f"the dashboard queries metrics nobody exports: {unknown}"
    missing = {what: name for what, name in REQUIRED.items() if name not in asked}
    assert not missing, f"the dashboard does not show {missing}"


def test_the_dashboard_is_well_formed(dashboard):
    panels = [p for p in dashboard["panels"]]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] == "cgx-ps" and dashboard["templating"]["list"][0]["type"] == "datasource"
    boxes = []
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for other, o in boxes:  # no two panels overlap
            overlap = g["x"] < o["x"] + o["w"] and o["x"] < g["x"] + g["w"] and \
                g["y"] < o["y"] + o["h"] and o["y"] < g["y"] + g["h"]
            assert not overlap, (p["title"], other)
        boxes.append((p["title"], g))
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"] and p.get("description"), p["title"]
