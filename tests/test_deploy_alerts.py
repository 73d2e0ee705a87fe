"""deploy/prometheus/alerts.yml and the chart's PrometheusRule: every rule reads only series the API's /metrics
really carries (names and labels from the text the API serves: the process registry, as api/routes/scrape.py
answers, with the farm-wide series a FarmCollector yields), and every expression is evaluated by tests/promql.py
against two such scrapes: a sick farm fires each alert for the sick model only, a healthy one fires none. The
chart renders the same rules with the flag on (and its thresholds as values)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from tests.promql import Evaluator, Scrape
from tests.test_deploy_monitoring import metric_uses

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
# labels Prometheus adds to every scraped series (targets), not the farm
TARGET_LABELS = {"namespace", "instance", "job", "pod", "release"}
OK, BAD = "alerts-ok-model", "alerts-bad-model"  # label values no other test uses (the counters are process-wide)


def rules(groups) -> dict[str, dict]:
    out = {}
    for g in groups:
        for r in g["rules"]:
            assert r["alert"] not in out, r["alert"]
            out[r["alert"]] = r
    return out


def file_rules() -> dict[str, dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    assert set(doc) == {"groups"}
    return rules(doc["groups"])


def _render_mod():
    spec = importlib.util.spec_from_file_location("farm_deploy_render_alerts",
                                                  ROOT / "deploy" / "kubernetes" / "render.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def scrape_text(workers: list[tuple[str, str]], waiting: dict[tuple[str, str], float], redis_up: bool) -> str:
    """What GET /metrics answers (api/routes/scrape.py: generate_latest() of the process registry): the API's own
    metrics, registered by importing api.app, and the farm-wide series of a FarmCollector that read `workers`
    ((model, role) with a live heartbeat carrying a real engine's stats) and `waiting` from Redis."""
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

    import api.app  # noqa: F401 - registers every metric the API process serves
    from farm.cluster.registry import WorkerInfo
    from farm.engine.timings import RequestTimings, RequestTokens
    from farm.telemetry import prometheus
    from farm.telemetry.prometheus import _FarmWide

    wide = _FarmWide()
    tokens = RequestTokens(2048).snapshot()
    stats = {"running": 1, "waiting": 0, "kv_usage": 0.5, "blocks_total": 10, "blocks_free": 5,
             "prompt_tokens": tokens["prompt_tokens"], "request_success": tokens["request_success"],
             "histograms": {**RequestTimings().snapshot(), **tokens["histograms"]}}
    wide.exporting = True
    wide.workers = [(WorkerInfo(f"{role}-{i}@h", role, model, "h", 1, 16), stats)
                    for i, (model, role) in enumerate(workers)]
    wide.queues = {f"farm.{m}.generate": int(n) for (m, _), n in waiting.items()}
    wide.waiting = dict(waiting)
    reg = CollectorRegistry()
    for c in list(REGISTRY._collector_to_names):  # noqa: SLF001 - the API process's metrics, without a FarmCollector
        if not isinstance(c, _FarmWide):          # another test's app may have registered (with its own state)
            reg.register(c)
    reg.register(wide)
    before = prometheus.REDIS_UP._value.get()  # noqa: SLF001
    prometheus.REDIS_UP.set(1 if redis_up else 0)  # what FarmCollector.refresh sets before the text is generated
    try:
        return generate_latest(reg).decode()
    finally:
        prometheus.REDIS_UP.set(before)


def up(answered: bool) -> str:
    """Prometheus' own series for the API's scrape job (not in /metrics: Prometheus adds it to every target). In
    the sick farm's last scrape one API replica did not answer."""
    return f'up{{job="farm-api",instance="api-0"}} {int(answered)}\nup{{job="farm-api",instance="api-1"}} 1\n'


def catalog(text: str) -> dict[str, set[str]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


@pytest.fixture(scope="module")
def scrapes():
    """(sick before, sick after, healthy before, healthy after): the sick model has no worker that generates (a
    prefill worker only), a growing backlog,
    half its answers 503 and every first token after 10 s, and Redis goes down; the healthy farm has workers for
    both models, a steady backlog, Redis up and no traffic in between."""
    from farm.telemetry import prometheus as p

    for model in (OK, BAD):  # series that exist before the traffic, as the farm's own do after their first request
        for status in ("200", "503"):
            p.REQUESTS.labels(model=model, status=status)
        p.TTFT_SECONDS.labels(model=model)
    sick = [(OK, "both"), (BAD, "prefill")]  # BAD's prefill worker lives on: nothing generates its answers
    s1 = Scrape.parse(scrape_text(sick, {(OK, "both"): 1, (BAD, "both"): 5}, True), 0.0)
    p.REQUESTS.labels(model=OK, status="200").inc(100)
    p.REQUESTS.labels(model=BAD, status="200").inc(50)
    p.REQUESTS.labels(model=BAD, status="503").inc(50)
    for _ in range(100):
        p.observe_latency(OK, 0.1, 0.01)
    for _ in range(50):
        p.observe_latency(BAD, 10.0, 0.01)
    s2 = Scrape.parse(scrape_text(sick, {(OK, "both"): 1, (BAD, "both"): 40}, False) + up(False), 600.0)
    healthy = [(OK, "both"), (BAD, "both")]
    h1 = Scrape.parse(scrape_text(healthy, {(OK, "both"): 3, (BAD, "both"): 12}, True) + up(True), 1000.0)
    h2 = Scrape.parse(scrape_text(healthy, {(OK, "both"): 3, (BAD, "both"): 12}, True) + up(True), 1600.0)
    return s1, s2, h1, h2


def models(result) -> set[str | None]:
    assert isinstance(result, dict), result
    return {dict(labels).get("model") for labels in result}


def test_the_rules_file_is_well_formed():
    rs = file_rules()
    assert set(rs) == {"FarmModelHasNoLiveWorker", "FarmAPIErrorRate", "FarmTTFTBudgetFastBurn",
                       "FarmTTFTBudgetSlowBurn", "FarmRedisDown", "FarmRequestsWaitingGrowing", "FarmAPIDown"}
    for name, r in rs.items():
        assert set(r) == {"alert", "expr", "for", "labels", "annotations"}, name
        assert re.fullmatch(r"\d+[smh]", r["for"]) and r["labels"]["severity"] in ("warning", "critical"), name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
        assert r["expr"].count("(") == r["expr"].count(")"), name
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["alerts.yml"]
    compose = yaml.safe_load((ROOT / "deploy" / "docker" / "docker-compose.yml").read_text())
    assert "../prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in compose["services"]["prometheus"]["volumes"]
    k8s = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus-kubernetes.yml").read_text())
    assert k8s["rule_files"] == ["alerts.yml"]
    # FarmAPIDown reads Prometheus' `up` of the API's scrape job: the job is farm-api in both configurations
    for doc in (prom, k8s):
        assert "farm-api" in [job["job_name"] for job in doc["scrape_configs"]]


def test_rules_read_only_series_the_farm_exports(scrapes):
    cat = catalog(scrape_text([(OK, "both")], {(OK, "both"): 1}, True) + up(True))
    assert "farm_redis_up" in cat and "farm_ttft_seconds_bucket" in cat and "farm_requests_waiting" in cat
    for name, r in file_rules().items():
        uses = metric_uses(r["expr"])
        assert uses, name
        for metric, labels in uses:
            assert metric in cat, f"{name}: {metric} is not a series the farm exports"
            assert labels - TARGET_LABELS <= cat[metric], f"{name}: {metric} has no label {labels - cat[metric]}"
            if metric.endswith(("_total", "_bucket")):
                assert re.search(rf"(rate|increase)\({re.escape(metric)}\b", r["expr"]), f"{name}: {metric} without rate()"
    buckets = {dict(k)["le"] for k in scrapes[1].samples if dict(k)["__name__"] == "farm_ttft_seconds_bucket"}
    for name in ("FarmTTFTBudgetFastBurn", "FarmTTFTBudgetSlowBurn"):
        les = set(re.findall(r'le="([^"]+)"', file_rules()[name]["expr"]))
        assert les and les <= buckets, f"{name}: the threshold must be a bucket bound of farm_ttft_seconds ({buckets})"


def test_each_alert_fires_for_the_sick_farm_only(scrapes):
    s1, s2, h1, h2 = scrapes
    sick, healthy = Evaluator(s1, s2), Evaluator(h1, h2)
    expected = {"FarmModelHasNoLiveWorker": {BAD}, "FarmAPIErrorRate": {BAD}, "FarmTTFTBudgetFastBurn": {BAD},
                "FarmTTFTBudgetSlowBurn": {BAD}, "FarmRedisDown": {None}, "FarmRequestsWaitingGrowing": {BAD},
                "FarmAPIDown": {None}}
    for name, r in file_rules().items():
        fired = sick.eval(r["expr"])
        assert models(fired) == expected[name], (name, fired)
        assert healthy.eval(r["expr"]) == {}, name
    errors = sick.eval(file_rules()["FarmAPIErrorRate"]["expr"])
    assert list(errors.values()) == [0.5]
    burn = sick.eval(file_rules()["FarmTTFTBudgetFastBurn"]["expr"])
    assert list(burn.values()) == [pytest.approx(100.0)], "every request missed: 1 / (1 - 0.99)"
    assert list(sick.eval(file_rules()["FarmRequestsWaitingGrowing"]["expr"]).values()) == [40.0]


def _released(s: Scrape, release: str, t: float) -> Scrape:
    """`s` as Prometheus stores it for one release of the chart (both scrape configurations label it `release`)."""
    return Scrape(t, {frozenset(k | {("namespace", "llm"), ("release", release)}): v for k, v in s.samples.items()})


def test_two_releases_in_one_namespace_are_two_farms(scrapes):
    """Two releases of the chart serving the same models in one namespace: the sick one fires, and the healthy one's
    workers, answers and first tokens do not hide its sickness (grouped by namespace and model alone, the healthy
    release's live workers answered for the sick one's model)."""
    s1, s2, h1, h2 = scrapes
    before, after = _released(s1, "sick", 0.0), _released(s2, "sick", 600.0)
    ev = Evaluator(Scrape(0.0, {**before.samples, **_released(h1, "well", 0.0).samples}),
                   Scrape(600.0, {**after.samples, **_released(h2, "well", 600.0).samples}))
    for name, r in file_rules().items():
        fired = {(dict(k).get("release"), dict(k).get("model")) for k in ev.eval(r["expr"])}
        assert fired == {("sick", None if name in ("FarmRedisDown", "FarmAPIDown") else BAD)}, (name, fired)


def test_the_evaluator_handles_what_the_rules_use(scrapes):
    s1, s2, _, _ = scrapes
    ev = Evaluator(s1, s2)
    sel = f'farm_requests_waiting{{model="{BAD}"}}'
    assert models(ev.eval(f"{sel} > 4")) == {BAD}
    assert ev.eval(f"{sel} < 4") == {}
    assert models(ev.eval('farm_requests_waiting >= 40')) == {BAD}
    assert models(ev.eval('1 < farm_requests_waiting')) == {BAD}
    assert list(ev.eval(f"delta({sel}[10m])").values()) == [35.0]
    assert models(ev.eval('farm_requests_waiting unless farm_workers')) == {BAD}
    assert models(ev.eval('farm_requests_waiting and farm_workers')) == {OK}
    with pytest.raises(SyntaxError):
        ev.eval("1 > bool 0")
    with pytest.raises(SyntaxError):
        ev.eval("1 > 0")


# -- the chart's PrometheusRule -----------------------------------------------------------------------------------
def _chart_rules(values: dict) -> dict[str, dict] | None:
    mod = _render_mod()
    objs = mod.manifests(mod.render(values, name="farm", namespace="llm"))
    found = [o for o in objs if o["kind"] == "PrometheusRule"]
    if not found:
        return None
    (rule,) = found
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["name"] == "farm-inference-farm-alerts"
    return rule, rules(rule["spec"]["groups"])


def _same(a: dict, b: dict) -> bool:
    return {**a, "expr": " ".join(a["expr"].split())} == {**b, "expr": " ".join(b["expr"].split())}


def test_the_chart_renders_the_same_rules_when_enabled(scrapes):
    assert _chart_rules({}) is None, "off by default"
    obj, rendered = _chart_rules({"metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "prom"}}}})
    assert obj["metadata"]["labels"]["release"] == "prom"
    ours = file_rules()
    assert set(rendered) == set(ours)
    for name in ours:
        if name == "FarmAPIDown":  # the operator's job label: the ServiceMonitor's, the API Service's name
            assert rendered[name]["expr"].split() == ['up{job="farm-inference-farm-api",', 'namespace="llm"}', "==",
                                                      "0"]
            continue
        assert _same(rendered[name], ours[name]), (name, rendered[name], ours[name])


def test_the_charts_thresholds_are_values(scrapes):
    s1, s2, _, _ = scrapes
    _, rendered = _chart_rules({"metrics": {"prometheusRule": {
        "enabled": True, "ttftSeconds": "16.0", "ttftObjective": 0.9, "errorRatio": 0.6, "waitingRequests": 50}}})
    assert 'le="16.0"' in rendered["FarmTTFTBudgetFastBurn"]["expr"] and "(1 - 0.9)" in rendered[
        "FarmTTFTBudgetFastBurn"]["expr"]
    ev = Evaluator(s1, s2)
    assert ev.eval(rendered["FarmTTFTBudgetFastBurn"]["expr"]) == {}, "10 s first tokens are within 16 s"
    assert ev.eval(rendered["FarmAPIErrorRate"]["expr"]) == {}, "50% is below 60%"
    assert ev.eval(rendered["FarmRequestsWaitingGrowing"]["expr"]) == {}, "40 waiting is below 50"
    assert "0.9 of them within 16.0 s" in rendered["FarmTTFTBudgetFastBurn"]["annotations"]["description"]


@pytest.mark.parametrize("bad", [{"ttftSeconds": "3"}, {"ttftSeconds": 2}, {"ttftObjective": 1},
                                 {"errorRatio": 0}, {"waitingRequests": -1}, {"treshold": 1}])
def test_the_values_schema_refuses_bad_thresholds(bad):
    import helm_python as helm

    with pytest.raises(helm.HelmError):
        _render_mod().render({"metrics": {"prometheusRule": {"enabled": True, **bad}}})


def test_the_threshold_enum_is_the_histograms_buckets(scrapes):
    spec = importlib.util.spec_from_file_location("farm_deploy_values_schema_alerts",
                                                  ROOT / "deploy" / "kubernetes" / "values_schema.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    buckets = {dict(k)["le"] for k in scrapes[1].samples if dict(k)["__name__"] == "farm_ttft_seconds_bucket"}
    assert set(mod.TTFT_BUCKET_LABELS) == buckets - {"+Inf"}


def test_every_scrape_says_whether_redis_answered():
    """farm_redis_up: FarmCollector.refresh (run by GET /metrics before the text is generated) sets it in every API
    replica, the one exporting the farm-wide series or not."""
    from farm.telemetry import prometheus as p

    class FakeRedis:
        def __init__(self, up: bool):
            self.up = up

        def register_script(self, _script):
            def lease(keys, args):
                if not self.up:
                    raise ConnectionError("Redis is down")
                return 0  # another replica exports the farm-wide series

            return lease

    before = p.REDIS_UP._value.get()  # noqa: SLF001
    try:
        p.FarmCollector(FakeRedis(False), None).refresh()
        assert p.REDIS_UP._value.get() == 0  # noqa: SLF001
        p.FarmCollector(FakeRedis(True), None).refresh()
        assert p.REDIS_UP._value.get() == 1  # noqa: SLF001
    finally:
        p.REDIS_UP.set(before)


def test_every_series_the_api_serves_is_documented():
    """The ops audit found a dozen exported series in no table: each farm_* and vllm:* family the API's /metrics
    carries is named in deploy/README.md (counters by their _total name)."""
    from prometheus_client.parser import text_string_to_metric_families

    doc = (ROOT / "deploy" / "README.md").read_text()
    prefixes = tuple(re.findall(r"`(\w+)_\*`", doc))  # a family of series named by its prefix (`farm_planner_*`)
    text = scrape_text([(OK, "both")], {(OK, "both"): 1}, True)  # and whatever else this session's tests registered
    families = {(f.name, f.type) for f in text_string_to_metric_families(text) if f.name.startswith(("farm_", "vllm:"))}
    missing = [name for name, kind in families if not name.endswith("_created") and not name.startswith(prefixes)
               and f"`{name}{'_total' if kind == 'counter' else ''}" not in doc]
    assert not missing, missing
