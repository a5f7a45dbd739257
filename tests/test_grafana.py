"""The Grafana dashboard deploy/grafana/jaxllm.json against the metrics the server exports.

Offline and in milliseconds: the JSON is importable (schema version, a Prometheus `datasource`
variable every panel uses, a `model_name` variable), panels have unique ids and a layout that fits
the 24-column grid without overlaps, every query names only sample names that the real
`server.metrics.Metrics` renders (`tests.test_deploy.metric_names`), filters on `$model_name`, and
the dashboard covers what an operator needs (throughput, latencies, queue, caches, compilations,
padding, host time, speculative decoding).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "jaxllm.json"
METRIC = re.compile(r"(?<![\w:])(?:vllm|jaxllm):[A-Za-z0-9_:]+")
MODEL_FILTER = re.compile(r'model_name=~?"\$(?:model_name|\{model_name\})"')
DATASOURCE = "${datasource}"
QUANTILE = re.compile(r"histogram_quantile\((0\.\d+)")

# Sample names the dashboard must query: one or more per concept it is there to show.
REQUIRED = {
    # throughput and finished requests
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    # latencies
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    # queue
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:request_queue_time_seconds_bucket",
    # caches and preemption
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:num_preemptions_total",
    # the engine: compilations, padding waste, host time per step
    "jaxllm:num_compilations_total",
    "jaxllm:scheduled_tokens_total",
    "jaxllm:padded_tokens_total",
    "jaxllm:step_host_time_seconds_bucket",
    # speculative decoding
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_draft_tokens_total",
}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' collapsed children included."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def query_panels(dashboard: dict) -> list[dict]:
    return [p for p in all_panels(dashboard) if p["type"] != "row"]


def exprs(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in query_panels(dashboard) for t in p["targets"]]


def datasource_uid(ds) -> str | None:
    return ds if isinstance(ds, str) else (ds or {}).get("uid")


def test_importable(dashboard):
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["title"] and dashboard["uid"]
    assert dashboard.get("id") is None  # an import must not carry another instance's id
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    model = variables["model_name"]
    assert model["type"] == "query"
    assert datasource_uid(model["datasource"]) == DATASOURCE
    query = model["query"]["query"] if isinstance(model["query"], dict) else model["query"]
    assert query.replace(" ", "") == "label_values(vllm:num_requests_running,model_name)"


def test_panels_structure(dashboard):
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    for panel in query_panels(dashboard):
        title = panel["title"]
        assert title, panel["id"]
        assert datasource_uid(panel["datasource"]) == DATASOURCE, title
        assert panel["targets"], title
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), title
        for target in panel["targets"]:
            assert target["expr"].strip(), title
            assert datasource_uid(target.get("datasource", DATASOURCE)) == DATASOURCE, title
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{title}: no unit"


def test_layout(dashboard):
    """Every panel has a gridPos inside the 24 columns, and no two panels overlap."""
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:  # top level: collapsed rows' children are laid out apart
        g = panel["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0, panel["title"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
    for panel in all_panels(dashboard):
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys(), panel["title"]


def test_units(dashboard):
    for panel in query_panels(dashboard):
        unit = panel["fieldConfig"]["defaults"]["unit"]
        targets = panel["targets"]
        if all(
            re.match(r"histogram_quantile\(.*_seconds_bucket", t["expr"], re.S) for t in targets
        ):
            assert unit == "s", panel["title"]
        if unit == "percentunit":
            assert panel["fieldConfig"]["defaults"].get("max", 1) <= 1, panel["title"]
    units = {p["title"]: p["fieldConfig"]["defaults"]["unit"] for p in query_panels(dashboard)}
    for title, unit in units.items():
        lower = title.lower()
        if "rate" in lower or "usage" in lower or "waste" in lower:
            assert unit == "percentunit", title
    assert "reqps" in units.values()


def test_queries_are_wellformed(dashboard):
    for title, expr in exprs(dashboard):
        depth = 0
        for ch in expr:
            depth += {"(": 1, ")": -1}.get(ch, 0)
            assert depth >= 0, f"{title}: {expr}"
        assert depth == 0, f"{title}: {expr}"
        assert expr.count("{") == expr.count("}"), f"{title}: {expr}"
        for name in METRIC.findall(expr):
            if name.endswith("_bucket"):  # a quantile over all replicas' buckets, by le
                assert "histogram_quantile(" in expr and "by (le)" in expr, f"{title}: {expr}"
                assert f"rate({name}{{" in expr, f"{title}: {expr}"


def test_model_name_filter(dashboard):
    """Every metric selector in every panel query filters on the model_name variable (every
    metric the server exports carries the model_name label)."""
    for title, expr in exprs(dashboard):
        names = METRIC.findall(expr)
        assert names, f"{title}: no metric in {expr}"
        for m in METRIC.finditer(expr):
            rest = expr[m.end() :]
            selector = re.match(r"\{[^}]*\}", rest)
            assert selector and MODEL_FILTER.search(selector.group()), (
                f"{title}: {m.group()} without the $model_name filter in {expr}"
            )


def test_covers_required_metrics(dashboard):
    used = {name for _, expr in exprs(dashboard) for name in METRIC.findall(expr)}
    missing = REQUIRED - used
    assert not missing, f"the dashboard does not show {sorted(missing)}"
    titles = " ".join(p["title"].lower() for p in query_panels(dashboard))
    for word in ("throughput", "first token", "inter-token", "queue", "kv cache", "prefix cache"):
        assert word in titles, word
    for word in ("preemption", "compilation", "padding", "host time", "acceptance"):
        assert word in titles, word
    for name in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
    ):
        qs = {q for _, e in exprs(dashboard) if name in e for q in QUANTILE.findall(e)}
        assert {"0.5", "0.9", "0.99"} <= qs, f"{name}: quantiles {sorted(qs)}"


def test_metrics_are_exported(dashboard):
    """Every sample name a query or variable reads is one the real collector renders."""
    from tests.test_deploy import metric_names

    exported = metric_names()
    queries = [expr for _, expr in exprs(dashboard)]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if variable["type"] == "query":
            queries.append(query["query"] if isinstance(query, dict) else query)
    unknown = {name for q in queries for name in METRIC.findall(q)} - exported
    assert not unknown, f"/metrics does not export {sorted(unknown)}"


def test_readme():
    readme = (ROOT / "deploy" / "grafana" / "README.md").read_text()
    assert "jaxllm.json" in readme
    assert "/metrics" in readme
