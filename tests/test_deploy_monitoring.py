"""deploy/prometheus and deploy/grafana: the scrape configurations find what the compose file and the
Helm chart run, and the dashboard queries only series the farm's /metrics really carries, with their labels:
names and labels come from the registry the API serves (the API's own metrics and the farm-wide series a
FarmCollector yields), never from a list written here. tests/test_metrics_live.py then runs every panel's
query against a real farm after real traffic."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "inference-farm.json"

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


def metric_catalog() -> dict[str, set[str]]:
    """Every series name the API's /metrics can carry, with its label names (`le` for buckets): the API
    process's own metrics, as registered when its modules are imported, and the farm-wide series exactly as
    farm.telemetry.prometheus yields them for a worker whose heartbeat carries a real engine's stats."""
    from prometheus_client import REGISTRY

    import api.app  # noqa: F401 - registers every metric the API process serves
    from farm.cluster.registry import WorkerInfo
    from farm.engine.timings import RequestTimings, RequestTokens
    from farm.telemetry.prometheus import _FarmWide

    out: dict[str, set[str]] = {}
    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 - names and labels of every metric
        name, labels, kind = getattr(collector, "_name", None), getattr(collector, "_labelnames", None), \
            getattr(collector, "_type", None)
        if name is None:
            continue
        labels = set(labels)
        if kind == "counter":
            out[f"{name}_total"] = labels
        elif kind == "histogram":
            out[f"{name}_bucket"], out[f"{name}_sum"], out[f"{name}_count"] = labels | {"le"}, labels, labels
        else:
            out[name] = labels
    wide = _FarmWide()
    tokens = RequestTokens(2048).snapshot()
    stats = {"running": 1, "waiting": 2, "kv_usage": 0.5, "blocks_total": 10, "blocks_free": 5, "cached_blocks": 1,
             "prefix_query_tokens": 10, "prefix_hit_tokens": 4, "preemptions": 0, "tokens_generated": 3,
             "tiers": {"host": {"used": 1, "capacity_blocks": 4}, "disk": {"used": 0, "capacity_blocks": 8}},
             "prompt_tokens": tokens["prompt_tokens"], "request_success": tokens["request_success"],
             "histograms": {**RequestTimings().snapshot(), **tokens["histograms"]}}
    wide.exporting = True
    wide.workers = [(WorkerInfo("decode-1@h", "decode", "m", "h", 1, 16), stats)]
    wide.queues, wide.waiting = {"farm.m.decode": 0}, {("m", "decode"): 2.0}
    wide.counters = {"farm_batch_lines": {"completed": 1.0}, "farm_batches": {"completed": 1.0}}
    for fam in wide.collect():
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def test_dashboard_queries_only_series_the_farm_exports():
    """Every selector of every panel names a series the API's /metrics carries, filtered and grouped only by
    labels that series has (this is what found the two panels that were always empty)."""
    dash = json.loads(DASHBOARD.read_text())
    catalog = metric_catalog()
    assert "vllm:num_requests_waiting" in catalog and "farm_requests_total" in catalog
    for expr in expressions(dash["panels"]):
        assert expr.count("(") == expr.count(")"), expr
        uses = metric_uses(expr)
        assert uses, f"no metric in {expr}"
        for name, labels in uses:
            assert name in catalog, f"{name} is not a series the farm exports ({expr})"
            assert labels <= catalog[name], f"{name} has no label {labels - catalog[name]} ({expr})"
            if name.endswith("_bucket"):
                assert "histogram_quantile" in expr and "le" in labels, expr
            if name.endswith("_total") or name.endswith("_bucket"):
                assert re.search(rf"(rate|increase)\({re.escape(name)}\b", expr), f"counter {name} used without rate()"
    for q in template_queries(dash):
        m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", q)
        assert m and m.group(1) in catalog and m.group(2) in catalog[m.group(1)], q


# What vLLM's own Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json: every selector of its
# panels, read from it, the JSON itself not copied here) and llm-d's and KEDA's recipes read of a `vllm serve`, by
# model_name: the farm's /metrics carries each with vLLM's labels, so those dashboards work against the farm
# unchanged. That dashboard still reads two names from before vLLM V1 (gpu_cache_usage_perc,
# time_per_output_token_seconds), which vLLM 0.31 itself no longer exports: the farm exports them too.
VLLM_DASHBOARD_SERIES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    *(f"vllm:{h}_{part}" for h in ("request_prompt_tokens", "request_generation_tokens",
                                    "request_max_num_generation_tokens", "e2e_request_latency_seconds",
                                    "time_to_first_token_seconds", "inter_token_latency_seconds",
                                    "request_queue_time_seconds", "request_prefill_time_seconds",
                                    "request_decode_time_seconds", "request_inference_time_seconds",
                                    "request_time_per_output_token_seconds", "time_per_output_token_seconds")
      for part in ("bucket", "sum", "count")),
)


def test_vllm_dashboard_series_are_exported_with_vllms_labels():
    catalog = metric_catalog()
    for name in VLLM_DASHBOARD_SERIES:
        assert name in catalog, name
        assert {"model_name", "engine"} <= catalog[name], (name, catalog[name])
    assert "finished_reason" in catalog["vllm:request_success_total"]


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


@pytest.mark.parametrize(("password", "starts"), [
    (None, False), ("", False), ("admin", False), ("change-me-grafana", False), ("s3cret-9f2c", True)])
def test_grafana_needs_a_real_admin_password(tmp_path, password, starts):
    """The monitoring profile's Grafana refused nothing: it started with `admin`/`admin` on the host's loopback.
    Its start command (run here by /bin/sh, with a stand-in for the image's /run.sh) now refuses an empty password,
    `admin` and the example's placeholder, and passes a real one to Grafana."""
    grafana = yaml.safe_load((DEPLOY / "docker" / "docker-compose.yml").read_text())["services"]["grafana"]
    assert grafana["entrypoint"] == ["/bin/sh", "-c"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_ADMIN_PASSWORD:-}"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    run = tmp_path / "run.sh"
    run.write_text('#!/bin/sh\necho "grafana started with $GF_SECURITY_ADMIN_PASSWORD"\n')
    run.chmod(0o755)
    script = grafana["command"][0].replace("$$", "$").replace("/run.sh", str(run))
    env = {"PATH": "/usr/bin:/bin"} | ({} if password is None else {"GF_SECURITY_ADMIN_PASSWORD": password})
    out = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=10)
    if starts:
        assert out.returncode == 0 and out.stdout.strip() == f"grafana started with {password}"
    else:
        assert out.returncode == 1 and "set GRAFANA_ADMIN_PASSWORD" in out.stderr and not out.stdout


def test_prometheus_compose_targets_exist():
    jobs = _jobs(DEPLOY / "prometheus" / "prometheus.yml")
    services = yaml.safe_load((DEPLOY / "docker" / "docker-compose.yml").read_text())["services"]
    assert set(jobs) == {"farm-api", "farm-workers", "farm-batch"}
    # the batch drivers' own series (the ops audit: no launcher served them): every `batch` replica by DNS
    assert jobs["farm-batch"]["dns_sd_configs"] == [{"names": ["batch"], "type": "A", "port": 9100}]
    assert services["batch"]["command"][-4:] == ["--metrics-port", "9100", "--metrics-host", "0.0.0.0"]
    for job in jobs.values():
        assert job["metrics_path"] == "/metrics"
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                host, port = target.split(":")
                assert host in services, target
    assert jobs["farm-api"]["static_configs"][0]["targets"] == ["api:8080"]
    assert services["api"]["environment"]["FARM_API__PORT"] == "8080"
    # /metrics answers only a key or the metrics token; Flower only its basic auth: both come from files the
    # compose file writes from the same variables the API and Flower get
    assert jobs["farm-api"]["authorization"]["credentials_file"] == "/tmp/farm-metrics-token"
    assert {"username_file", "password_file"} <= set(jobs["farm-workers"]["basic_auth"])
    start = services["prometheus"]["command"][0]
    for path in ("/tmp/farm-metrics-token", "/tmp/flower-user", "/tmp/flower-password"):
        assert path in start
    assert services["api"]["environment"]["FARM_METRICS_TOKEN"] == services["prometheus"]["environment"][
        "FARM_METRICS_TOKEN"]
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
    assert {k: [c for c, _ in v] for k, v in kept.items()} == {"farm-api": ["api"], "farm-workers": ["flower"],
                                                               "farm-drivers": ["batch"]}
    batch = kept["farm-drivers"][0][1]
    assert (batch["__address__"], batch["__metrics_path__"]) == ("10.0.0.7:9100", "/metrics")
    api = kept["farm-api"][0][1]
    assert (api["__address__"], api["__metrics_path__"]) == ("10.0.0.7:8080", "/metrics")
    flower = kept["farm-workers"][0][1]
    assert (flower["__address__"], flower["__metrics_path__"]) == ("10.0.0.7:5555", "/metrics")
