"""deploy/prometheus and deploy/grafana: the scrape configurations find what the compose file and the
Helm chart run, and the dashboard queries only the farm's metric names (with their labels)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "inference-farm.json"

# The farm's metrics the dashboard may use, with their labels (`le` for histogram buckets).
METRICS: dict[str, set[str]] = {
    "farm_routing_decisions_total": {"mode", "stage"},
    "farm_routing_stage_seconds_bucket": {"stage", "le"},
    "farm_router_predicted_hit_blocks_total": set(),
    "farm_router_request_blocks_total": set(),
    "farm_requests_shed_total": {"stage"},
    "farm_prompt_tokens_total": {"model"},
    "farm_cached_prompt_tokens_total": {"model"},
    "farm_completion_tokens_total": {"model"},
    "farm_prefill_total": {"mode"},
    "farm_requests_total": {"model", "status"},
    "farm_ttft_seconds_bucket": {"model", "le"},
    "farm_itl_seconds_bucket": {"model", "le"},
    "farm_e2e_latency_seconds_bucket": {"model", "le"},
    "farm_queue_depth": {"queue"},
    "farm_kv_blocks": {"worker", "tier", "state"},
    "farm_semantic_cache_hits_total": set(),
    "farm_guard_blocks_total": {"guard"},
    "farm_batch_lines_total": {"state"},
}
PROMQL_WORDS = {
    # functions
    "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "clamp_min", "clamp_max",
    "clamp", "abs", "ceil", "floor", "round", "sqrt", "exp", "ln", "log2", "log10", "time", "vector", "scalar",
    "label_replace", "label_join", "avg_over_time", "max_over_time", "min_over_time", "sum_over_time",
    "count_over_time", "absent", "sort", "sort_desc",
    # aggregations and keywords
    "sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "stddev", "stdvar", "group",
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
}


def expressions(node) -> list[str]:
    """Every PromQL expression in the dashboard (panel targets and template variable queries)."""
    out = []
    if isinstance(node, dict):
        if isinstance(node.get("expr"), str):
            out.append(node["expr"])
        for v in node.values():
            out += expressions(v)
    elif isinstance(node, list):
        for v in node:
            out += expressions(v)
    return out


def template_queries(dash) -> list[str]:
    out = []
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append(q)
            assert var.get("definition", q) == q
    return out


def metric_uses(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, label names it is filtered or grouped by) for each selector; fails on unknown words."""
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    uses = []
    # label names in by/without/on/ignoring (...) clauses apply to the metrics of the expression
    grouped = set()
    for m in re.finditer(r"\b(by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        grouped |= {x.strip() for x in m.group(2).split(",") if x.strip()}
    body = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", expr)
    body = re.sub(r"\[[^\]]*\]", "", body)  # range selectors
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{([^}]*)\})?", body):
        word, matchers = m.group(1), m.group(3)
        if word in PROMQL_WORDS:
            assert matchers is None, f"{word}{{...}} in {expr}"
            continue
        labels = {lm.group(1) for lm in re.finditer(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"', matchers or "")}
        uses.append((word, labels))
    # strings and numbers are all that may remain
    rest = re.sub(r'"[^"]*"', "", body)
    rest = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", rest)
    rest = re.sub(r"[a-zA-Z_:][a-zA-Z0-9_:]*|\d+(\.\d+)?(e-?\d+)?|[-+*/^%(),<>=!\s]", "", rest)
    assert rest == "", f"unparsed {rest!r} in {expr}"
    return [(name, labels | grouped) for name, labels in uses]


def test_dashboard_parses_and_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "inference-farm" and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs))
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "model"} <= names
    for expr in expressions(dash["panels"]):
        for var in re.findall(r"\$(?!__)(\w+)", expr):
            assert var in names, f"${var} in {expr}"


def test_dashboard_queries_only_farm_metrics():
    dash = json.loads(DASHBOARD.read_text())
    used = set()
    for expr in expressions(dash["panels"]):
        assert expr.count("(") == expr.count(")"), expr
        uses = metric_uses(expr)
        assert uses, f"no metric in {expr}"
        for name, labels in uses:
            assert name in METRICS, f"{name} is not a farm metric ({expr})"
            assert labels <= METRICS[name], f"{name} has no label {labels - METRICS[name]} ({expr})"
            if name.endswith("_bucket"):
                assert "histogram_quantile" in expr and "le" in labels, expr
            if name.endswith("_total") or name.endswith("_bucket"):
                assert re.search(rf"(rate|increase)\({name}\b", expr), f"counter {name} used without rate()"
            used.add(name)
    for q in template_queries(dash):
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", q)
        assert m and m.group(1) in METRICS and m.group(2) in METRICS[m.group(1)], q
    assert used == set(METRICS), f"metrics without a panel: {set(METRICS) - used}"


def test_labels_exist_on_the_metrics_the_farm_defines_today():
    """For the metrics farm/metrics.py already defines, the dashboard uses only labels they have
    (the others are coming: their names and labels are the ones agreed in METRICS)."""
    text = (ROOT / "farm" / "metrics.py").read_text()
    defined = {}
    for m in re.finditer(r'(?:Counter|Gauge|Histogram)\(\s*"(farm_[a-z0-9_]+)",\s*"[^"]*"\s*(?:,\s*\[([^\]]*)\])?', text):
        defined[m.group(1)] = set(re.findall(r'"(\w+)"', m.group(2) or ""))
    assert {"farm_routing_decisions_total", "farm_prompt_tokens_total", "farm_prefill_total"} <= set(defined)
    dash = json.loads(DASHBOARD.read_text())
    for expr in expressions(dash["panels"]):
        for name, labels in metric_uses(expr):
            base = name.removesuffix("_bucket") if name.endswith("_bucket") else name
            if base in defined:
                assert labels - {"le"} <= defined[base], f"{base} has labels {defined[base]}: {expr}"


def test_grafana_provisioning():
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus" and ds["datasources"][0]["url"] == "http://prometheus:9090"
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "inference-farm.yml").read_text())
    path = prov["providers"][0]["options"]["path"]
    grafana = yaml.safe_load((DEPLOY / "docker" / "docker-compose.yml").read_text())["services"]["grafana"]
    assert f"../grafana/inference-farm.json:{path}/inference-farm.json:ro" in grafana["volumes"]
    assert "../grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]


def _jobs(path: Path) -> dict[str, dict]:
    cfg = yaml.safe_load(path.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert len(jobs) == len(cfg["scrape_configs"])
    assert re.fullmatch(r"\d+[smh]", cfg["global"]["scrape_interval"])
    return jobs


def test_prometheus_compose_targets_exist():
    jobs = _jobs(DEPLOY / "prometheus" / "prometheus.yml")
    services = yaml.safe_load((DEPLOY / "docker" / "docker-compose.yml").read_text())["services"]
    assert set(jobs) == {"farm-api", "farm-workers"}
    for job in jobs.values():
        assert job["metrics_path"] == "/metrics"
        for sc in job["static_configs"]:
            for target in sc["targets"]:
                host, port = target.split(":")
                assert host in services, target
    assert jobs["farm-api"]["static_configs"][0]["targets"] == ["api:8080"]
    api = services["api"]
    assert "python:api.gunicorn_conf" in api["command"]  # binds to FARM_API__HOST:FARM_API__PORT
    assert (api["environment"]["FARM_API__HOST"], str(api["environment"]["FARM_API__PORT"])) == ("0.0.0.0", "8080")
    assert "--port=5555" in services["flower"]["command"]
    prom = services["prometheus"]
    assert "../prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]


@pytest.fixture(scope="module")
def chart_pods():
    spec = importlib.util.spec_from_file_location("farm_deploy_render", DEPLOY / "kubernetes" / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    objs = render.manifests(render.render({}, name="farm", namespace="llm"))
    return [o["spec"]["template"]["metadata"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def _meta_labels(pod_meta: dict) -> dict[str, str]:
    """Prometheus' kubernetes_sd meta labels of a pod (labels and annotations)."""
    out = {}
    for prefix, items in (("label", pod_meta.get("labels", {})), ("annotation", pod_meta.get("annotations", {}))):
        for k, v in items.items():
            out[f"__meta_kubernetes_pod_{prefix}_" + re.sub(r"[^a-zA-Z0-9_]", "_", k)] = str(v)
    return out


def test_prometheus_kubernetes_discovers_the_charts_pods(chart_pods):
    jobs = _jobs(DEPLOY / "prometheus" / "prometheus-kubernetes.yml")
    kept = {}
    for name, job in jobs.items():
        assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
        for pod in chart_pods:
            labels = {**_meta_labels(pod), "__address__": "10.0.0.7:1234"}
            keep = True
            for rule in job["relabel_configs"]:
                src = ";".join(labels.get(s, "") for s in rule.get("source_labels", []))
                m = re.fullmatch(rule.get("regex", "(.*)"), src)
                action = rule.get("action", "replace")
                if action == "keep" and not m:
                    keep = False
                    break
                if action == "replace" and m:
                    repl = re.sub(r"\$(\d+)", r"\\\1", rule.get("replacement", "$1"))
                    labels[rule["target_label"]] = m.expand(repl)
            if keep:
                kept.setdefault(name, []).append((pod["labels"]["app.kubernetes.io/component"], labels))
    assert {k: [c for c, _ in v] for k, v in kept.items()} == {"farm-api": ["api"], "farm-workers": ["flower"]}
    api = kept["farm-api"][0][1]
    assert (api["__address__"], api["__metrics_path__"]) == ("10.0.0.7:8080", "/metrics")
    flower = kept["farm-workers"][0][1]
    assert (flower["__address__"], flower["__metrics_path__"]) == ("10.0.0.7:5555", "/metrics")
