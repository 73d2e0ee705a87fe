"""The Helm chart (deploy/kubernetes/helm/inference-farm), rendered and linted by Helm's own Go engine.

helm-python-sdk binds Helm's Go SDK (v4) in a shared library shipped in its wheel, so the templates,
values.schema.json, `fail`/`required` and Sprig behave as with `helm template` / `helm lint --strict`.
Every rendered object is validated against the Kubernetes OpenAPI schemas bundled in
kubernetes-validate (strict: unknown fields fail) for the oldest and newest Kubernetes the chart
supports; KEDA and Prometheus Operator objects against the fields of their CRDs. Then the farm itself checks
what the chart hands it: the ConfigMap and the pods' FARM_* environment load with farm.config.load_config,
worker, batch driver and planner commands parse with their own parsers, the planner finds the worker
Deployments, KEDA asks Prometheus for the requests waiting for each worker's model and role (the series the
API exports: tests/test_metrics_live.py evaluates the rendered query against a real farm under backlog), the
probes split liveness from readiness, the values schema rejects unknown keys at every level and matches the
farm's configuration model, and the worker liveness probe is run against a real Redis. Offline, no cluster,
no helm binary.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml

from farm.cli.main import build_parser
from farm.cluster import registry
from farm.config import load_config
from farm.config.planner import load_planner_config
from farm.planner.actuators import deployment_name

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"farm_deploy_{name}", ROOT / "deploy" / "kubernetes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render_mod = _load("render")

CHART = render_mod.CHART
EXAMPLES = CHART / "examples"
NAMESPACE = "llm"
RELEASE = "farm"
# Chart.yaml says kubeVersion >=1.27; kubernetes-validate bundles schemas up to 1.37.
K8S_VERSIONS = ("1.27.0", "1.37.0")

# The Dynamo chart's CLI (semantic-router-with-dynamo): model.path only, explicit prefill/decode.
SEED_CLI = [
    "workers[0].model.path=Qwen/Qwen2-0.5B-Instruct", "workers[0].workerType=prefill",
    "workers[1].model.path=Qwen/Qwen2-0.5B-Instruct", "workers[1].workerType=decode",
    "frontend.routerMode=round-robin", "modelStorage.type=existingClaim", "modelStorage.existingClaim=models",
]

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "disaggregated": render_mod.load_values([EXAMPLES / "values-disaggregated.yaml"]),
    "aggregated-keda": render_mod.load_values([EXAMPLES / "values-aggregated-keda.yaml"]),
    "gpu": render_mod.load_values([EXAMPLES / "values-gpu.yaml"]),
    "seed-cli": render_mod.load_values([], SEED_CLI),
    "external-redis": {
        "redis": {"enabled": False, "externalUrl": "redis://:pw@redis.example:6379/0"},
        "flower": {"enabled": False},
        "modelStorage": {"type": "hostPath", "hostPath": "/srv/models", "prepare": {"enabled": False}},
        "secrets": {"farmSecret": "s3cret", "apiKeys": ["k1", "k2"]},
        "keda": {"enabled": True, "prometheus": {"serverAddress": "http://prometheus.monitoring.svc:9090",
                                                 "extraMatchers": 'job="farm-api"'}},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                    "prometheusRule": {"enabled": True, "labels": {"release": "prom"}}},
        "frontend": {"autoscaling": {"enabled": True, "maxReplicas": 5}},
        "podDisruptionBudget": {"enabled": False},
        "topologySpread": {"enabled": False},
        "batchDriver": {"replicas": 2, "concurrency": 4},
        "workers": [{"name": "agg", "workerType": "both", "model": {"name": "SmolLM2-135M-Instruct"},
                     "keda": {"maxReplicas": 3}}],
    },
    # Redis Sentinel (redis.ha): the chart's own primary + replica + 3 sentinels
    "redis-ha": {"redis": {"ha": {"enabled": True}}, "planner": {"enabled": True}},
    # Redis Sentinel of your own: no Redis objects, the farm pointed at the given sentinels
    "external-sentinel": {
        "redis": {"enabled": False, "externalUrl": "redis://:pw@unused:6379/2",
                  "ha": {"enabled": True, "masterName": "mymaster",
                         "externalSentinels": ["s0.redis.svc:26379", "s1.redis.svc:26379", "10.0.0.7:5000"]}},
        "planner": {"enabled": True},
    },
}

_cache: dict[str, list[dict[str, Any]]] = {}


def objects(case: str) -> list[dict[str, Any]]:
    if case not in _cache:
        rendered = render_mod.render(VALUE_SETS[case], name=RELEASE, namespace=NAMESPACE)
        _cache[case] = render_mod.manifests(rendered)
    return _cache[case]


def by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def pod_specs(objs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(owner object, pod spec) of every workload."""
    return [(o, o["spec"]["template"]["spec"]) for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def component(o: dict[str, Any]) -> str:
    return o["metadata"]["labels"].get("app.kubernetes.io/component", "")


def workers(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: d for n, d in by_kind(objs, "Deployment").items() if component(d) == "worker"}


def container(pod: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    cs = pod["containers"]
    return cs[0] if name is None else next(c for c in cs if c["name"] == name)


def resolved_env(c: dict[str, Any], objs: list[dict[str, Any]] = ()) -> dict[str, str]:
    """A container's environment as the kubelet builds it: the downward API with stand-ins, secrets
    from the rendered Secrets (a stand-in for secrets made elsewhere), $(VAR) references expanded
    from the variables defined earlier in the list."""
    secrets = {s["metadata"]["name"]: s.get("data", {}) for s in objs if s["kind"] == "Secret"}
    fields = {"metadata.name": "farm-worker-7d9f-abcde", "status.podIP": "10.1.2.3",
              "metadata.namespace": NAMESPACE}
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                    lambda m: env.get(m.group(1), m.group(0)), str(e["value"]))
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            data = secrets.get(ref["name"], {}).get(ref["key"])
            env[e["name"]] = base64.b64decode(data).decode() if data is not None else "s3cret"
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def cfg_batch_backend(env: dict[str, str], cfg_path: Path) -> str:
    return load_config(environ={**env, "FARM_CONFIG": str(cfg_path)}).batch.files_backend


def farm_cfg_file(objs: list[dict[str, Any]], tmp_path: Path, key: str = "farm.yaml") -> Path:
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-config"))
    path = tmp_path / key
    path.write_text(cm["data"][key])
    return path


# ---- Helm lint and Kubernetes schemas ----------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_helm_lint_strict(case):
    assert render_mod.lint(VALUE_SETS[case], namespace=NAMESPACE) == []


def test_helm_lint_oldest_supported_kubernetes():
    assert render_mod.lint({}, namespace=NAMESPACE, kube_version="v1.27.0") == []


_KEDA_TRIGGER_AUTH = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "TriggerAuthentication"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "additionalProperties": False, "properties": {
            "secretTargetRef": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["parameter", "name", "key"],
                "properties": {"parameter": {"type": "string"}, "name": {"type": "string"},
                               "key": {"type": "string"}}}},
            "env": {"type": "array"}, "podIdentity": {"type": "object"}}},
    },
}
# The fields of KEDA's ScaledObject CRD (keda.sh/v1alpha1) the chart may use, and the Prometheus scaler's
# metadata keys; KEDA's CRD types trigger metadata as map[string]string.
_PROMETHEUS_SCALER_KEYS = ["serverAddress", "query", "threshold", "activationThreshold", "ignoreNullValues",
                           "namespace", "customHeaders", "queryParameters", "unsafeSsl", "timeout", "authModes"]
_KEDA_SCALED_OBJECT = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "additionalProperties": False, "required": ["scaleTargetRef", "triggers"],
                 "properties": {
            "scaleTargetRef": {"type": "object", "additionalProperties": False, "required": ["name"],
                               "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                              "name": {"type": "string"},
                                              "envSourceContainerName": {"type": "string"}}},
            "pollingInterval": {"type": "integer", "minimum": 1},
            "cooldownPeriod": {"type": "integer", "minimum": 0},
            "initialCooldownPeriod": {"type": "integer", "minimum": 0},
            "idleReplicaCount": {"type": "integer", "minimum": 0},
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "advanced": {"type": "object", "additionalProperties": False, "properties": {
                "restoreToOriginalReplicaCount": {"type": "boolean"},
                "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False, "properties": {
                    "name": {"type": "string"},
                    "behavior": {"type": "object", "additionalProperties": False, "properties": {
                        "scaleUp": {"$ref": "#/definitions/rules"}, "scaleDown": {"$ref": "#/definitions/rules"}}}}},
                "scalingModifiers": {"type": "object"}}},
            "fallback": {"type": "object"},
            "triggers": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["type", "metadata"],
                "properties": {
                    "type": {"const": "prometheus"}, "name": {"type": "string"},
                    "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                    "useCachedMetrics": {"type": "boolean"},
                    "metadata": {"type": "object", "additionalProperties": False,
                                 "required": ["serverAddress", "query", "threshold"],
                                 "properties": {k: {"type": "string"} for k in _PROMETHEUS_SCALER_KEYS}},
                    "authenticationRef": {"type": "object", "additionalProperties": False, "required": ["name"],
                                          "properties": {"name": {"type": "string"},
                                                         "kind": {"enum": ["TriggerAuthentication",
                                                                           "ClusterTriggerAuthentication"]}}}}}},
        }},
    },
    "definitions": {"rules": {"type": "object", "additionalProperties": False, "properties": {
        "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["type", "value", "periodSeconds"],
            "properties": {"type": {"enum": ["Pods", "Percent"]}, "value": {"type": "integer", "minimum": 1},
                           "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800}}}}}}},
}


# The fields of the Prometheus Operator's ServiceMonitor CRD (monitoring.coreos.com/v1) the chart uses.
_SECRET_KEY = {"type": "object", "additionalProperties": False, "required": ["name", "key"],
               "properties": {"name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}}}
_SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "endpoints"], "properties": {
            "jobLabel": {"type": "string"},
            "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "selector": {"type": "object", "additionalProperties": False, "properties": {
                "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                "matchExpressions": {"type": "array"}}},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                    "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    "honorLabels": {"type": "boolean"},
                    "authorization": {"type": "object", "additionalProperties": False, "properties": {
                        "type": {"type": "string"}, "credentials": _SECRET_KEY}},
                    "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"}}}}}},
    },
}


# The fields of the Prometheus Operator's PrometheusRule CRD (monitoring.coreos.com/v1) the chart uses
# (tests/test_deploy_alerts.py checks the rules themselves).
_DURATION = {"type": "string", "pattern": "^(([0-9]+)(y|w|d|h|m|s|ms))+$"}
_PROMETHEUS_RULE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "additionalProperties": False, "properties": {
            "groups": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["name", "rules"], "properties": {
                    "name": {"type": "string", "minLength": 1}, "interval": _DURATION,
                    "rules": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "required": ["expr"], "properties": {
                            "alert": {"type": "string"}, "record": {"type": "string"},
                            "expr": {"type": ["string", "integer"]}, "for": _DURATION,
                            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                            "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}}}}}}},
    },
}


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_manifests_match_kubernetes_schemas(case):
    errors = []
    for o in objects(case):
        where = f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"
        if o.get("apiVersion", "").startswith(("keda.sh/", "monitoring.coreos.com/")):
            schema = {"ScaledObject": _KEDA_SCALED_OBJECT, "TriggerAuthentication": _KEDA_TRIGGER_AUTH,
                      "ServiceMonitor": _SERVICE_MONITOR, "PrometheusRule": _PROMETHEUS_RULE}[o["kind"]]
            errors += [f"{where}: {e.message} at {list(e.path)}"
                       for e in jsonschema.Draft7Validator(schema).iter_errors(o)]
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                errors.append(f"{where} (k8s {version}): {e.message} at {list(e.path)}")
            except kubernetes_validate.SchemaNotFoundError as e:
                errors.append(f"{where}: {e.message}")
    assert not errors, "\n".join(errors)


DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_names_labels_and_uniqueness(case):
    seen = set()
    for o in objects(case):
        name = o["metadata"]["name"]
        assert (o["kind"], name) not in seen, f"duplicate {o['kind']}/{name}"
        seen.add((o["kind"], name))
        assert DNS_LABEL.match(name) and len(name) <= 63, f"{o['kind']} name {name!r} is not a DNS-1123 label"
        labels = dict(o["metadata"].get("labels") or {})
        if o["kind"] in ("Deployment", "StatefulSet"):
            labels.update(o["spec"]["template"]["metadata"]["labels"])
        for k, v in labels.items():
            assert len(str(v)) <= 63 and LABEL_VALUE.match(str(v)), f"{name}: label {k}={v!r} is invalid"
        assert o["metadata"].get("namespace") in (None, NAMESPACE)


# ---- wiring: every reference resolves ------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_references_resolve(case):
    objs = objects(case)
    values = VALUE_SETS[case]
    secrets = {n: set(s.get("data", {})) for n, s in by_kind(objs, "Secret").items()}
    external = {values.get("secrets", {}).get("existingSecret"),
                values.get("redis", {}).get("auth", {}).get("existingSecret"),
                values.get("flower", {}).get("auth", {}).get("existingSecret"),
                values.get("keda", {}).get("passwordSecret", {}).get("name")} - {None, ""}
    configmaps = {n: set(c.get("data", {})) for n, c in by_kind(objs, "ConfigMap").items()}
    accounts = set(by_kind(objs, "ServiceAccount")) | {"default"}
    claims = set(by_kind(objs, "PersistentVolumeClaim"))
    for owner, pod in pod_specs(objs):
        where = f"{owner['kind']}/{owner['metadata']['name']}"
        # selectors select the pod template
        tpl_labels = owner["spec"]["template"]["metadata"]["labels"]
        assert owner["spec"]["selector"]["matchLabels"].items() <= tpl_labels.items(), where
        assert pod.get("serviceAccountName", "default") in accounts, where
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, f"{where}: volume {v['name']}"
            if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] not in claims:
                assert v["persistentVolumeClaim"]["claimName"] == values.get("modelStorage", {}).get(
                    "existingClaim"), f"{where}: claim {v['persistentVolumeClaim']['claimName']}"
        templates = {t["metadata"]["name"] for t in owner["spec"].get("volumeClaimTemplates", [])}
        for c in pod.get("initContainers", []) + pod["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes or m["name"] in templates, f"{where}/{c['name']}: mount {m['name']}"
            defined: set[str] = set()
            for e in c.get("env", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(e.get("value", ""))):
                    assert ref in defined, f"{where}/{c['name']}: {e['name']} uses $({ref}) before it is defined"
                defined.add(e["name"])
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref and ref["name"] not in external and not ref.get("optional"):
                    assert ref["key"] in secrets.get(ref["name"], set()), f"{where}/{c['name']}: {e['name']} -> {ref}"
            for arg in c.get("command", []) + c.get("args", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert ref in defined, f"{where}/{c['name']}: command uses undefined $({ref})"
            ports = {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = ((c.get(probe) or {}).get("httpGet") or {}).get("port")
                if isinstance(port, str):
                    assert port in ports, f"{where}/{c['name']}: {probe} port {port}"
    pods = [(o["spec"]["template"]["metadata"]["labels"], o["spec"]["template"]["spec"]) for o, _ in pod_specs(objs)]
    for name, svc in by_kind(objs, "Service").items():
        matching = [spec for labels, spec in pods if svc["spec"]["selector"].items() <= labels.items()]
        assert matching, f"Service {name} selects no pod"
        for p in svc["spec"]["ports"]:
            if isinstance(p["targetPort"], str):
                assert any(p["targetPort"] in {cp.get("name") for c in spec["containers"] for cp in c.get("ports", [])}
                           for spec in matching), f"Service {name}: targetPort {p['targetPort']}"
    deployments = by_kind(objs, "Deployment")
    for name, so in by_kind(objs, "ScaledObject").items():
        assert so["spec"]["scaleTargetRef"]["name"] in deployments, name
    for name, hpa in by_kind(objs, "HorizontalPodAutoscaler").items():
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments, name
    for name, sm in by_kind(objs, "ServiceMonitor").items():
        ref = sm["spec"]["endpoints"][0]["authorization"]["credentials"]
        assert ref["name"] in external or ref["key"] in secrets.get(ref["name"], set()), f"{name}: {ref}"
    pod_labels = [o["spec"]["template"]["metadata"]["labels"] for o, _ in pod_specs(objs)]
    for name, pdb in by_kind(objs, "PodDisruptionBudget").items():
        sel = pdb["spec"]["selector"]["matchLabels"].items()
        assert sum(sel <= labels.items() for labels in pod_labels) == 1, f"PDB {name} selects one workload's pods"
    for name, rb in by_kind(objs, "RoleBinding").items():
        assert rb["roleRef"]["name"] in by_kind(objs, "Role"), name
        assert {s["name"] for s in rb["subjects"]} <= accounts, name


# ---- what the farm makes of it ------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_farm_loads_the_rendered_configuration(case, tmp_path):
    objs = objects(case)
    cfg_path = farm_cfg_file(objs, tmp_path)
    values = VALUE_SETS[case]
    router_mode = values.get("frontend", {}).get("routerMode", "kv")
    farm_containers = [(o, c) for o, pod in pod_specs(objs) if component(o) not in ("redis", "redis-sentinel")
                       for c in pod.get("initContainers", []) + pod["containers"]]
    assert farm_containers
    for owner, c in farm_containers:
        env = resolved_env(c, objs)
        env["FARM_CONFIG"] = str(cfg_path)  # the mounted ConfigMap, here
        assert c["env"][0]["name"] == "FARM_CONFIG" or c["name"] == "worker"
        assert cfg_batch_backend(env, cfg_path) == "redis", "every API replica and batch driver sees every file"
        cfg = load_config(environ=env)  # unknown keys, bad values or env overrides raise ConfigError
        assert cfg.default_model in [m.name for m in cfg.models]
        assert not cfg.redis.managed
        if c["name"] == "prepare-models":
            continue
        assert cfg.router.mode == router_mode, f"{owner['metadata']['name']}: FARM_ROUTER__MODE"
        assert cfg.redis.url.startswith("redis://") and "$(" not in cfg.redis.url
        assert len(env["FARM_SECRET"]) >= 6
        if owner["kind"] == "Deployment" and c["name"] in ("worker", "api"):
            assert env["FARM_REDIS__URL"].startswith("redis://:" + (
                "pw@" if case in ("external-redis", "external-sentinel") else env["REDIS_PASSWORD"] + "@"))
        assert cfg.redis.ha.enabled == bool(values.get("redis", {}).get("ha", {}).get("enabled"))
        if component(owner) == "worker":
            assert cfg.transfer.advertise_host == "10.1.2.3"  # the pod IP
            assert cfg.transfer.bind_host == "0.0.0.0"
    if case == "gpu":
        worker = next(c for o, c in farm_containers if c["name"] == "worker")
        cfg = load_config(environ={**resolved_env(worker, objs), "FARM_CONFIG": str(cfg_path)})
        assert (cfg.engine.device, cfg.engine.dtype, cfg.engine.kv_tiers.host_mb) == ("cuda", "bfloat16", 8192)
        assert cfg.model("Qwen2-0.5B-Instruct").path == "/var/lib/farm/models/Qwen/Qwen2-0.5B-Instruct"


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_worker_deployments(case):
    objs = objects(case)
    values = VALUE_SETS[case]
    entries = values.get("workers") or yaml.safe_load((CHART / "values.yaml").read_text())["workers"]
    deps = workers(objs)
    assert len(deps) == len(entries)
    parser = build_parser()
    scaled = {so["spec"]["scaleTargetRef"]["name"] for so in by_kind(objs, "ScaledObject").values()}
    planner = values.get("planner", {}).get("enabled") and not values.get("planner", {}).get("dryRun")
    for entry, (name, dep) in zip(entries, deps.items(), strict=True):
        pod = dep["spec"]["template"]["spec"]
        c = container(pod, "worker")
        env = resolved_env(c)
        role = entry.get("workerType", "both")
        model = entry["model"].get("name") or entry["model"]["path"]
        # `farm worker --role R --model M --name <role>@<pod name>`, as the farm CLI parses it
        assert c["command"][0] == "farm"
        args = parser.parse_args(expand(c["command"][1:], env))
        assert (args.command, args.role, args.model) == ("worker", role, model)
        assert args.name == env["WORKER_ID"] == f"{role}@farm-worker-7d9f-abcde"
        assert next(e for e in c["env"] if e["name"] == "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.name"
        # warm shutdown: a long grace period; Celery's SIGTERM handling does the rest
        assert pod["terminationGracePeriodSeconds"] >= 600
        # GPUs: limits["nvidia.com/gpu"] = gpuDevice, and the GPU taint tolerated
        gpus = int(entry.get("gpuDevice") or 0)
        limits = c.get("resources", {}).get("limits", {})
        if gpus:
            assert limits["nvidia.com/gpu"] == gpus
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
            assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
            assert c["image"].endswith("-cuda")
        else:
            assert "nvidia.com/gpu" not in limits
        for key in ("nodeSelector",):
            if entry.get(key):
                assert pod[key] == entry[key]
        # replicas: from the entry unless KEDA or the planner owns the count
        if name in scaled or planner:
            assert "replicas" not in dep["spec"]
        else:
            assert dep["spec"]["replicas"] == entry.get("replicas", 1)


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_probes(case, tmp_path):
    objs = objects(case)
    for name, dep in workers(objs).items():
        c = container(dep["spec"]["template"]["spec"], "worker")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            cmd = c[probe]["exec"]["command"]
            assert cmd[:2] == ["python", "-c"], f"{name} {probe}"
            assert 'os.environ["WORKER_ID"]' in cmd[2] and '"farm:alive:"' in cmd[2]
            assert c[probe]["timeoutSeconds"] < c[probe]["periodSeconds"] + 1
        assert c["startupProbe"]["exec"]["command"][3:] == ["strict"]
        assert c["livenessProbe"]["exec"]["command"][3:] == []
        # the startup probe allows minutes of model loading; liveness reacts within a minute
        s, live = c["startupProbe"], c["livenessProbe"]
        assert s["periodSeconds"] * s["failureThreshold"] >= 300
        assert live["periodSeconds"] * live["failureThreshold"] <= 60
    api = by_kind(objs, "Deployment")[f"{RELEASE}-inference-farm-api"]
    c = container(api["spec"]["template"]["spec"], "api")
    # liveness never depends on Redis (a Redis outage must not restart every API pod); readiness does
    assert c["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert api["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 35
    from gunicorn.config import Config

    from api.server import settings

    assert c["command"][0] == "gunicorn"
    args = Config().parser().parse_args(c["command"][1:])  # as gunicorn parses it
    assert (args.config, args.args, args.worker_class, args.bind) == (
        "python:api.gunicorn_conf", ["api.app:create_app()"], None, None)
    # the settings module reads the pod's configuration (the ConfigMap): gevent, the port, the limits
    server = settings(load_config(environ={**resolved_env(c, objs), "FARM_CONFIG": str(farm_cfg_file(objs, tmp_path))}))
    frontend = VALUE_SETS[case].get("frontend", {})
    assert (server["worker_class"], server["bind"], server["worker_connections"], server["keepalive"]) == (
        "gevent", [f"0.0.0.0:{c['ports'][0]['containerPort']}"], frontend.get("workerConnections", 4096),
        frontend.get("headerTimeoutSeconds", 10))


def _probe_code(case: str = "default") -> tuple[list[str], list[str]]:
    dep = next(iter(workers(objects(case)).values()))
    c = container(dep["spec"]["template"]["spec"], "worker")
    return c["startupProbe"]["exec"]["command"], c["livenessProbe"]["exec"]["command"]


def test_worker_probe_tracks_the_heartbeat_in_redis(redis_url):
    """The exec probe from the rendered chart, run against a real Redis: it passes only while the
    worker's heartbeat key (written by farm.cluster.registry every 2 s, TTL 6 s) exists."""
    startup, liveness = _probe_code()
    wid = "decode@farm-inference-farm-smollm2-decode-5c8f-x2x4q"
    env = {"WORKER_ID": wid, "FARM_REDIS__URL": redis_url, "PATH": "/usr/bin:/bin"}
    r = redis.Redis.from_url(redis_url)
    r.delete(registry.alive_key(wid))

    def run(cmd, e=env):
        return subprocess.run([sys.executable, *cmd[1:]], env=e, capture_output=True, text=True, timeout=30)

    assert run(startup).returncode == 1, "no heartbeat yet (model loading): not started"
    assert run(liveness).returncode == 1
    registry.heartbeat(r, wid)
    assert run(startup).returncode == 0
    assert run(liveness).returncode == 0
    r.pexpire(registry.alive_key(wid), 1)  # the worker stopped refreshing it: the key expires
    import time

    time.sleep(0.05)
    assert run(liveness).returncode == 1, "a worker without heartbeat must fail its liveness probe"
    # Redis unreachable: startup/readiness fail, liveness does not restart the worker for it
    down = {**env, "FARM_REDIS__URL": "redis://127.0.0.1:9/0"}
    assert run(startup, down).returncode == 1
    assert run(liveness, down).returncode == 0
    r.close()


@pytest.mark.parametrize("mode", ["kv", "round-robin", "random"])
def test_router_mode_reaches_the_api(mode):
    objs = render_mod.manifests(render_mod.render({"frontend": {"routerMode": mode}}, name=RELEASE))
    api = by_kind(objs, "Deployment")[f"{RELEASE}-inference-farm-api"]
    env = {e["name"]: e.get("value") for e in container(api["spec"]["template"]["spec"])["env"]}
    assert env["FARM_ROUTER__MODE"] == mode


def test_keda_scales_workers_on_the_requests_waiting_for_their_model_and_role():
    """One ScaledObject per worker Deployment, asking Prometheus for farm_requests_waiting of exactly the model
    and role that Deployment's pods serve (`farm worker --role R --model M`); the query's value is what the
    real farm reports under backlog in tests/test_metrics_live.py."""
    for case in ("aggregated-keda", "external-redis"):
        objs = objects(case)
        deps = workers(objs)
        sos = by_kind(objs, "ScaledObject")
        assert set(sos) == set(deps)
        for name, so in sos.items():
            c = container(deps[name]["spec"]["template"]["spec"], "worker")
            args = build_parser().parse_args(expand(c["command"][1:], resolved_env(c)))
            (trigger,) = so["spec"]["triggers"]
            assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
            meta = trigger["metadata"]
            assert all(isinstance(v, str) for v in meta.values())
            matchers = 'job="farm-api"' if case == "external-redis" else f'namespace="{NAMESPACE}",release="{RELEASE}"'
            assert meta["query"] == keda_query(args.model, args.role, matchers)
            assert meta["serverAddress"] == VALUE_SETS[case]["keda"]["prometheus"]["serverAddress"]
            assert int(meta["threshold"]) >= 1 and meta["ignoreNullValues"] == "true"
            assert "replicas" not in deps[name]["spec"], "KEDA owns the replica count"
        assert so["spec"]["maxReplicaCount"] == (8 if case == "aggregated-keda" else 3)
    with pytest.raises(helm.HelmError, match="keda.prometheus.serverAddress"):
        render_mod.render({"keda": {"enabled": True}})


def keda_query(model: str, role: str, matchers: str) -> str:
    return f'sum(farm_requests_waiting{{model="{model}",role="{role}",{matchers}}})'


def test_batch_driver_runs_with_the_files_every_replica_sees(tmp_path):
    """A batch driver Deployment (without one a created batch never runs): `python -m tasks.batch` named after
    its pod, the farm's configuration and models, file bodies in Redis like the API's."""
    for case, replicas in (("default", 1), ("external-redis", 2)):
        objs = objects(case)
        dep = by_kind(objs, "Deployment")[f"{RELEASE}-inference-farm-batch"]
        assert dep["spec"]["replicas"] == replicas
        pod = dep["spec"]["template"]["spec"]
        c = container(pod, "batch")
        env = resolved_env(c, objs)
        cmd = expand(c["command"], env)
        assert cmd[:3] == ["python", "-m", "tasks.batch"]
        opts = dict(zip(cmd[3::2], cmd[4::2], strict=True))
        assert opts["--name"] == "batch@farm-worker-7d9f-abcde"
        if case == "external-redis":
            assert opts["--concurrency"] == "4"
        cfg = load_config(environ={**env, "FARM_CONFIG": str(farm_cfg_file(objs, tmp_path))})
        assert cfg.batch.files_backend == "redis" and cfg.redis.url.startswith("redis://:")
        assert {"name": "models", "mountPath": "/var/lib/farm/models", "readOnly": True} in c["volumeMounts"]
        assert pod["terminationGracePeriodSeconds"] >= 30, "warm shutdown hands the batches back"
    assert f"{RELEASE}-inference-farm-batch" not in by_kind(
        render_mod.manifests(render_mod.render({"batchDriver": {"enabled": False}})), "Deployment")


def test_disruption_budgets_autoscaler_service_monitor_and_spread():
    objs = objects("default")
    pdbs = by_kind(objs, "PodDisruptionBudget")
    deps = by_kind(objs, "Deployment")
    # a budget for the API, the batch drivers and every worker Deployment (not Flower, not the planner)
    covered = {n for n, d in deps.items() if any(p["spec"]["selector"]["matchLabels"].items()
                                                  <= d["spec"]["template"]["metadata"]["labels"].items()
                                                  for p in pdbs.values())}
    assert covered == {n for n, d in deps.items() if component(d) in ("api", "batch", "worker")}
    assert all(p["spec"]["maxUnavailable"] == 1 for p in pdbs.values())
    # topology spread: each constraint selects its own pods
    for name, d in deps.items():
        tpl = d["spec"]["template"]
        spread = tpl["spec"].get("topologySpreadConstraints")
        if component(d) in ("api", "batch", "worker"):
            (c,) = spread
            assert c["topologyKey"] == "kubernetes.io/hostname" and c["whenUnsatisfiable"] == "ScheduleAnyway"
            assert c["labelSelector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"], name
    assert not by_kind(objs, "HorizontalPodAutoscaler") and not by_kind(objs, "ServiceMonitor")
    assert deps[f"{RELEASE}-inference-farm-api"]["spec"]["replicas"] == 1
    # external-redis: the API autoscaled on CPU (no replica count of its own), scraped by a ServiceMonitor
    objs = objects("external-redis")
    api = by_kind(objs, "Deployment")[f"{RELEASE}-inference-farm-api"]
    hpa = by_kind(objs, "HorizontalPodAutoscaler")[f"{RELEASE}-inference-farm-api"]
    assert "replicas" not in api["spec"] and hpa["spec"]["maxReplicas"] == 5
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert container(api["spec"]["template"]["spec"], "api")["resources"]["requests"]["cpu"], "HPA needs a CPU request"
    sm = by_kind(objs, "ServiceMonitor")[f"{RELEASE}-inference-farm-api"]
    svc = by_kind(objs, "Service")[f"{RELEASE}-inference-farm-api"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["metadata"]["labels"]["release"] == "prom"
    ep = sm["spec"]["endpoints"][0]
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]} and ep["path"] == "/metrics"
    # the series get the release as `release`, as prometheus-kubernetes.yml gives them: KEDA's default matchers and
    # the alerts' groups read it (two releases of one model in one namespace are two farms)
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"],
            "targetLabel": "release"} in ep["relabelings"]
    assert api["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    # Prometheus presents the metrics token the API pods get as FARM_METRICS_TOKEN
    env = {e["name"]: e for e in container(api["spec"]["template"]["spec"], "api")["env"]}
    assert env["FARM_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"] == {**ep["authorization"]["credentials"],
                                                                      "optional": True}
    assert not by_kind(objs, "PodDisruptionBudget")
    assert all("topologySpreadConstraints" not in d["spec"]["template"]["spec"] for d in by_kind(objs, "Deployment").values())


def _walk_objects(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    if isinstance(node, dict):
        if node.get("type") == "object" or "properties" in node:
            out.append((path, node))
        for k, v in node.items():
            out += _walk_objects(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _walk_objects(v, f"{path}[{i}]")
    return out


# Kubernetes' own structures the chart passes through whole (the API server checks them when applied).
_PASS_THROUGH = re.compile(r"/(nodeAffinity|podAffinity|podAntiAffinity|valueFrom|seccompProfile|seLinuxOptions|podSelector|namespaceSelector|ipBlock)$")


def test_values_schema_is_the_generated_one_and_closed_at_every_level():
    schema_mod = _load("values_schema")
    assert schema_mod.main(["--check"]) == 0, "run: python deploy/kubernetes/values_schema.py"
    schema = json.loads((CHART / "values.schema.json").read_text())
    for path, node in _walk_objects(schema):
        if _PASS_THROUGH.search(path):
            continue
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{path} accepts unknown keys"
        else:
            assert "additionalProperties" in node, f"{path}: an object with no keys named must say what its map holds"
    # every key of values.yaml is in the schema (values.yaml validates against it, strictly)
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load((CHART / "values.yaml").read_text()))


@pytest.mark.parametrize("values, where", [
    ({"frontned": {}}, "frontned"),
    ({"frontend": {"replica": 2}}, "replica"),
    ({"workers": [{"workerType": "both", "model": {"name": "m", "maxModelLength": 9}}]}, "maxModelLength"),
    ({"workers": [{"workerType": "both", "model": {"name": "m"}, "engine": {"kv_cahce_mb": 1}}]}, "kv_cahce_mb"),
    ({"config": {"engine": {"kv_cahce_mb": 1}}}, "kv_cahce_mb"),
    ({"config": {"api": {"threads": 8}}}, "threads"),
    ({"planner": {"config": {"bounds": {"decode": {"mx": 3}}}}}, "mx"),
    ({"keda": {"prometheus": {"server": "http://p:9090"}}}, "server"),
    ({"redis": {"persistence": {"sise": "1Gi"}}}, "sise"),
    ({"redis": {"ha": {"enabeld": True}}}, "enabeld"),
    ({"redis": {"ha": {"sentinel": {"replica": 3}}}}, "replica"),
    ({"metrics": {"serviceMonitor": {"enable": True}}}, "enable"),
    ({"metrics": {"prometheusRule": {"enable": True}}}, "enable"),
    ({"batchDriver": {"replica": 2}}, "replica"),
])
def test_the_values_schema_rejects_unknown_keys_everywhere(values, where):
    with pytest.raises(helm.HelmError, match=re.escape(where)):
        render_mod.render(values)


def test_redis_statefulset_with_aof_password_and_volume():
    objs = objects("default")
    sts = by_kind(objs, "StatefulSet")[f"{RELEASE}-inference-farm-redis"]
    pod = sts["spec"]["template"]["spec"]
    c = container(pod, "redis")
    script = c["command"][2]
    assert "--appendonly yes" in script and "--appendfsync everysec" in script and "--dir /data" in script
    assert "requirepass" in script and "$REDIS_PASSWORD" in script and "--requirepass" not in script
    assert "--maxmemory-policy noeviction" in script  # queued requests are never evicted
    pw = next(e for e in c["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
    secret = by_kind(objs, "Secret")[pw["name"]]
    assert re.fullmatch(r"[A-Za-z0-9]{32}", base64.b64decode(secret["data"][pw["key"]]).decode())
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    assert "REDISCLI_AUTH" in " ".join(c["readinessProbe"]["exec"]["command"])
    given = render_mod.manifests(render_mod.render({"redis": {"auth": {"password": "abc123"},
                                                              "persistence": {"enabled": False}}}))
    secret = by_kind(given, "Secret")[f"{RELEASE}-inference-farm-redis"]
    assert base64.b64decode(secret["data"]["redis-password"]) == b"abc123"
    assert "volumeClaimTemplates" not in by_kind(given, "StatefulSet")[f"{RELEASE}-inference-farm-redis"]["spec"]


# ---- Redis Sentinel (redis.ha) ----------------------------------------------------------------------------

REDIS_STS = f"{RELEASE}-inference-farm-redis"
SENTINEL_STS = f"{RELEASE}-inference-farm-redis-sentinel"
HA_ENV = ("FARM_REDIS__HA__ENABLED", "FARM_REDIS__HA__MASTER_NAME", "FARM_REDIS__HA__SENTINELS",
          "FARM_REDIS__HA__QUORUM", "FARM_REDIS__HA__REPLICA_ACK_TIMEOUT_MS")


def farm_containers(objs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(owner, container) of every farm process (API, workers, batch driver, Flower, planner): not Redis,
    not the sentinels, not the model preparation (it does not talk to Redis)."""
    return [(o, c) for o, pod in pod_specs(objs) if component(o) not in ("redis", "redis-sentinel")
            for c in pod["containers"]]


def run_script(script: str, tmp_path: Path, hostname: str, sentinel_says: str = "",
               masters: tuple[str, ...] = ()) -> str:
    """A rendered start script run by sh (as pod `hostname`) with stand-ins for timeout, redis-cli and redis-server:
    the sentinels answer `sentinel_says` (nothing: none answers), the hosts in `masters` answer ROLE with
    master. Returns what redis-server would read: its config file, then its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stubs = {
        "timeout": 'shift; exec "$@"',
        "redis-cli": "\n".join([
            'args="$*"',
            'case "$args" in',
            f'  *"sentinel get-master-addr-by-name"*) [ -n "{sentinel_says}" ] || exit 1; '
            f'printf "%s\\n%s\\n" "{sentinel_says}" 6379 ;;',
            '  *" role") for m in ' + " ".join(masters or ("none",)) + '; do '
            '[ "$2" = "$m" ] && { echo master; exit 0; }; done; exit 1 ;;',
            '  *ping) echo PONG ;;',
            'esac']),
        "redis-server": 'cat "$1"; echo "ARGS $*"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    script = script.replace("/tmp/", f"{tmp_path}/").replace("/data/", f"{tmp_path}/")
    out = subprocess.run(["sh", "-c", script], env={"PATH": f"{bin_dir}:/usr/bin:/bin", "REDIS_PASSWORD": "pw1", "HOSTNAME": hostname},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def ha_farm_configs(objs: list[dict], tmp_path, sentinels: list[str]) -> list[tuple[dict, dict, Any]]:
    """Every farm container (API, workers, batch driver, Flower, planner) with its resolved env and the farm
    config it loads: each carries the HA settings and names exactly `sentinels`."""
    cfg_path = farm_cfg_file(objs, tmp_path)
    seen, out = set(), []
    for owner, c in farm_containers(objs):
        seen.add(component(owner))
        env = resolved_env(c, objs)
        assert set(HA_ENV) <= set(env), f"{owner['metadata']['name']}/{c['name']}"
        assert env["FARM_REDIS__HA__SENTINELS"] == ",".join(sentinels)
        out.append((c, env, load_config(environ={**env, "FARM_CONFIG": str(cfg_path)})))
    assert seen == {"api", "worker", "batch", "flower", "planner"}
    return out


def test_redis_ha_bundles_a_primary_a_replica_and_three_sentinels(tmp_path):
    objs = objects("redis-ha")
    sts = by_kind(objs, "StatefulSet")
    assert set(sts) == {REDIS_STS, SENTINEL_STS}
    redis_sts, sentinel_sts = sts[REDIS_STS], sts[SENTINEL_STS]
    assert redis_sts["spec"]["replicas"] == 2 and sentinel_sts["spec"]["replicas"] == 3
    # no Service over primary and replica together (writes would reach the replica); stable names instead
    services = by_kind(objs, "Service")
    assert REDIS_STS not in services
    for s in (redis_sts, sentinel_sts):
        headless = services[s["spec"]["serviceName"]]["spec"]
        assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
        # spread over nodes and under a disruption budget, like the farm's own pods
        (spread,) = s["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert spread["labelSelector"]["matchLabels"] == s["spec"]["selector"]["matchLabels"]
        assert any(p["spec"]["selector"]["matchLabels"] == s["spec"]["selector"]["matchLabels"]
                   for p in by_kind(objs, "PodDisruptionBudget").values())
    redis_c = container(redis_sts["spec"]["template"]["spec"], "redis")
    sentinel_c = container(sentinel_sts["spec"]["template"]["spec"], "sentinel")
    # one managed password (the chart's Secret) for data nodes, sentinels and every farm process
    pw_ref = next(e for e in redis_c["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
    assert pw_ref == next(e for e in sentinel_c["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
    assert pw_ref["name"] in by_kind(objs, "Secret")
    headless = redis_sts["spec"]["serviceName"]
    node = [f"{REDIS_STS}-{i}.{headless}.{NAMESPACE}.svc" for i in range(2)]

    # the data nodes: pod 0 starts as primary, pod 1 as its replica; after a failover (the sentinels name
    # another primary) a restarted pod 0 joins it as a replica instead of coming back as a second primary
    script = redis_c["command"][2]
    assert "--requirepass" not in script and "--appendonly yes" in script and "--maxmemory-policy noeviction" in script
    # split-brain protection, off by default (two data nodes: on, losing either would stop writes): when set, a
    # primary none of whose replicas acknowledged for that long refuses writes
    assert "--min-replicas" not in script
    on = render_mod.manifests(render_mod.render({"redis": {"ha": {"enabled": True, "minReplicasMaxLagSeconds": 5}}}))
    on_sts = next(o for o in on if o["kind"] == "StatefulSet" and o["metadata"]["name"] == REDIS_STS)
    assert "--min-replicas-to-write 1 --min-replicas-max-lag 5" in container(on_sts["spec"]["template"]["spec"],
                                                                              "redis")["command"][2]
    first = run_script(script, tmp_path, f"{REDIS_STS}-0")
    assert 'requirepass "pw1"' in first and 'masterauth "pw1"' in first and "replicaof" not in first
    assert f"replica-announce-ip {node[0]}" in first
    assert "--dir /data" in first
    second = run_script(script, tmp_path, f"{REDIS_STS}-1")
    assert f"replicaof {node[0]} 6379" in second and f"replica-announce-ip {node[1]}" in second
    after_failover = run_script(script, tmp_path, f"{REDIS_STS}-0", sentinel_says=node[1])
    assert f"replicaof {node[1]} 6379" in after_failover
    sentinels_down = run_script(script, tmp_path, f"{REDIS_STS}-0", masters=(node[1],))
    assert f"replicaof {node[1]} 6379" in sentinels_down, "no sentinel answers: the pod that says master"

    # the sentinels: monitor the master name at the primary with quorum 2, password both ways
    conf = run_script(sentinel_c["command"][2], tmp_path, f"{SENTINEL_STS}-1")
    lines = conf.splitlines()
    assert f"sentinel monitor farm {node[0]} 6379 2" in lines
    assert 'sentinel auth-pass farm "pw1"' in lines and 'requirepass "pw1"' in lines
    assert {"sentinel resolve-hostnames yes", "sentinel announce-hostnames yes",
            f"sentinel announce-ip {SENTINEL_STS}-1.{sentinel_sts['spec']['serviceName']}.{NAMESPACE}.svc"} <= set(lines)
    assert lines[-1].startswith("ARGS ") and lines[-1].endswith("--sentinel")
    conf = run_script(sentinel_c["command"][2], tmp_path, f"{SENTINEL_STS}-0", sentinel_says=node[1])
    assert f"sentinel monitor farm {node[1]} 6379 2" in conf.splitlines(), "a restarted sentinel follows the failover"
    port = sentinel_c["ports"][0]["containerPort"]
    expected = [f"{SENTINEL_STS}-{i}.{sentinel_sts['spec']['serviceName']}.{NAMESPACE}.svc:{port}" for i in range(3)]

    # every farm container (API, workers, batch driver, Flower, planner) goes through those sentinels
    from farm.infra.redis_client import celery_broker

    for _, env, cfg in ha_farm_configs(objs, tmp_path, expected):
        ha = cfg.redis.ha
        assert (ha.enabled, ha.master_name, ha.sentinels, ha.quorum) == (True, "farm", expected, 2)
        assert cfg.redis.url.startswith(f"redis://:{env['REDIS_PASSWORD']}@")
        urls, options = celery_broker(cfg.redis)
        assert urls.split(";") == [f"sentinel://:{env['REDIS_PASSWORD']}@{a}/0" for a in expected]
        assert options == {"master_name": "farm", "sentinel_kwargs": {"password": env["REDIS_PASSWORD"]}}


def test_external_sentinels_render_no_redis_and_point_the_farm_at_them(tmp_path):
    objs = objects("external-sentinel")
    assert not [o for o in objs if component(o).startswith("redis")]
    assert not by_kind(objs, "StatefulSet")
    assert f"{RELEASE}-inference-farm-redis" not in by_kind(objs, "Secret")
    given = VALUE_SETS["external-sentinel"]["redis"]["ha"]["externalSentinels"]
    for c, _, cfg in ha_farm_configs(objs, tmp_path, given):
        assert next(e for e in c["env"] if e["name"] == "FARM_REDIS__URL")["valueFrom"]["secretKeyRef"]["key"] == \
            "redis-url"
        assert (cfg.redis.ha.enabled, cfg.redis.ha.master_name) == (True, "mymaster")
        assert cfg.redis.ha.sentinel_addresses() == [("s0.redis.svc", 26379), ("s1.redis.svc", 26379), ("10.0.0.7", 5000)]
        assert cfg.redis.url == "redis://:pw@unused:6379/2"  # password and database


def test_master_names_yaml_would_misread_are_quoted(tmp_path):
    for name in ("yes", "1e3", "mymaster"):
        objs = render_mod.manifests(render_mod.render({"redis": {"ha": {"enabled": True, "masterName": name}}}))
        _, c = farm_containers(objs)[0]
        cfg = load_config(environ={**resolved_env(c, objs), "FARM_CONFIG": str(farm_cfg_file(objs, tmp_path))})
        assert cfg.redis.ha.master_name == name


def test_ha_worker_probe_finds_the_primary_through_a_real_sentinel(tmp_path):
    """The redis.ha heartbeat probe from the rendered chart, run against a real redis-server watched by a real
    redis-sentinel: it asks the sentinel for the primary (farm.infra.redis_client), like every farm process."""
    import shutil
    import time

    from farm.infra.orphans import die_with_parent
    from tests.conftest import free_port, start_redis

    dep = next(iter(workers(objects("redis-ha")).values()))
    c = container(dep["spec"]["template"]["spec"], "worker")
    startup, liveness = c["startupProbe"]["exec"]["command"], c["livenessProbe"]["exec"]["command"]
    assert "farm.infra.redis_client" in startup[2]
    proc, url = start_redis(tmp_path / "redis")
    sport = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {sport}\nbind 127.0.0.1\nsentinel monitor farm 127.0.0.1 {url.rsplit(':', 1)[1].split('/')[0]} 1\n")
    exe = shutil.which("redis-sentinel")
    sentinel = subprocess.Popen([exe, str(conf)] if exe else [shutil.which("redis-server"), str(conf), "--sentinel"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent())
    try:
        wid = "decode@farm-inference-farm-smollm2-decode-5c8f-x2x4q"
        env = {"WORKER_ID": wid, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "FARM_STATE_DIR": str(tmp_path),
               "FARM_REDIS__URL": "redis://127.0.0.1:9/1",  # not asked: the sentinel says where the primary is
               "FARM_REDIS__MANAGED": "false", "FARM_REDIS__HA__ENABLED": "true", "FARM_REDIS__HA__MASTER_NAME": "farm",
               "FARM_REDIS__HA__SENTINELS": f"127.0.0.1:{sport}", "FARM_REDIS__HA__QUORUM": "1"}
        r = redis.Redis.from_url(url.rsplit("/", 1)[0] + "/1")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=sport).sentinel_get_master_addr_by_name("farm"):
                    break
            except redis.RedisError:
                time.sleep(0.05)

        def run(cmd, e=env):
            return subprocess.run([sys.executable, *cmd[1:]], env=e, cwd=tmp_path, capture_output=True, text=True,
                                  timeout=30)

        r.delete(registry.alive_key(wid))
        assert run(startup).returncode == 1, "no heartbeat yet"
        registry.heartbeat(r, wid)
        assert run(startup).returncode == 0, run(startup).stderr
        # a fresh heartbeat again: the probes are Python start-ups, and two of them on a loaded machine outlast
        # the heartbeat's 6 s TTL (seen in CI: "has no heartbeat" right after the startup probe passed)
        registry.heartbeat(r, wid)
        assert run(liveness).returncode == 0
        r.delete(registry.alive_key(wid))
        assert run(liveness).returncode == 1
        down = {**env, "FARM_REDIS__HA__SENTINELS": "127.0.0.1:9"}  # no sentinel answers
        assert run(startup, down).returncode == 1
        assert run(liveness, down).returncode == 0, "a Redis outage alone restarts no worker"
        r.close()
    finally:
        for p in (sentinel, proc):
            p.terminate()
            p.wait(timeout=10)


def test_flower_basic_auth_from_a_secret():
    objs = objects("default")
    flower = by_kind(objs, "Deployment")[f"{RELEASE}-inference-farm-flower"]
    c = container(flower["spec"]["template"]["spec"], "flower")
    assert c["command"][:4] == ["celery", "-A", "tasks.celery_app", "flower"]
    ref = next(e for e in c["env"] if e["name"] == "FLOWER_BASIC_AUTH")["valueFrom"]["secretKeyRef"]
    auth = base64.b64decode(by_kind(objs, "Secret")[ref["name"]]["data"][ref["key"]]).decode()
    user, _, password = auth.partition(":")
    assert user == "admin" and len(password) >= 16
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthcheck"  # answers without auth


def test_api_keys_and_farm_secret():
    objs = objects("external-redis")
    secret = by_kind(objs, "Secret")[f"{RELEASE}-inference-farm-farm"]
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    token = data.pop("metrics-token")
    assert data == {"farm-secret": "s3cret", "api-keys": "k1,k2", "redis-url": "redis://:pw@redis.example:6379/0"}
    assert re.fullmatch(r"[A-Za-z0-9]{32}", token), "generated once (kept across upgrades like the other secrets)"
    # no key given: one is generated, so the API (which refuses 0.0.0.0 without a key) starts and serves no one
    # keyless through a proxy in its pod
    generated = by_kind(objects("default"), "Secret")[f"{RELEASE}-inference-farm-farm"]["data"]["api-keys"]
    assert re.fullmatch(r"[A-Za-z0-9]{32}", base64.b64decode(generated).decode())
    given = render_mod.manifests(render_mod.render({"secrets": {"metricsToken": "scrape-me"}}))
    assert base64.b64decode(by_kind(given, "Secret")[f"{RELEASE}-inference-farm-farm"]["data"]["metrics-token"]) == \
        b"scrape-me"
    api = by_kind(objs, "Deployment")[f"{RELEASE}-inference-farm-api"]
    env = {e["name"]: e for e in container(api["spec"]["template"]["spec"])["env"]}
    assert env["FARM_API_KEYS"]["valueFrom"]["secretKeyRef"]["key"] == "api-keys"
    assert env["FARM_REDIS__URL"]["valueFrom"]["secretKeyRef"]["key"] == "redis-url"


def test_planner_scales_the_worker_deployments(tmp_path):
    objs = objects("disaggregated")
    pcfg = load_planner_config(farm_cfg_file(objs, tmp_path, "planner.yaml"))
    assert (pcfg.actuator, pcfg.mode, pcfg.kubernetes.namespace) == ("kubernetes", "load", NAMESPACE)
    assert pcfg.bounds_for("decode").max == 6
    deps = set(workers(objs))
    for model in pcfg.models:
        for role in pcfg.roles:
            assert deployment_name(pcfg.kubernetes.deployment, model, role) in deps
    planner = by_kind(objs, "Deployment")[f"{RELEASE}-inference-farm-planner"]
    pod = planner["spec"]["template"]["spec"]
    c = container(pod, "planner")
    args = build_parser().parse_args(c["command"][1:])
    assert (args.command, args.planner_command, args.actuator) == ("planner", "run", "kubernetes")
    assert args.planner_config == "/etc/farm/planner.yaml"
    assert pod["serviceAccountName"] == f"{RELEASE}-inference-farm-planner" and pod["automountServiceAccountToken"]
    role = by_kind(objs, "Role")[f"{RELEASE}-inference-farm-planner"]
    assert any("deployments/scale" in r["resources"] and "patch" in r["verbs"] for r in role["rules"])
    assert planner["spec"]["strategy"]["type"] == "Recreate"
    assert f"{RELEASE}-inference-farm-planner" not in by_kind(objects("default"), "Deployment")


def test_model_storage_variants():
    for storage, expect in (({"type": "persistentVolumeClaim"}, {"persistentVolumeClaim": {
            "claimName": f"{RELEASE}-inference-farm-models"}}),
                            ({"type": "existingClaim", "existingClaim": "m"}, {"persistentVolumeClaim": {"claimName": "m"}}),
                            ({"type": "hostPath", "hostPath": "/srv/m"}, {"hostPath": {"path": "/srv/m",
                                                                                     "type": "DirectoryOrCreate"}}),
                            ({"type": "emptyDir"}, {"emptyDir": {}})):
        objs = render_mod.manifests(render_mod.render({"modelStorage": storage}))
        for owner, pod in pod_specs(objs):
            if component(owner) in ("api", "worker"):
                vol = next(v for v in pod["volumes"] if v["name"] == "models")
                assert {k: v for k, v in vol.items() if k != "name"} == expect
                mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models")
                assert mount == {"name": "models", "mountPath": "/var/lib/farm/models", "readOnly": True}
                init = pod["initContainers"][0]
                assert init["name"] == "prepare-models" and "farm" in init["command"][2]
        assert (f"{RELEASE}-inference-farm-models" in by_kind(objs, "PersistentVolumeClaim")) == (
            storage["type"] == "persistentVolumeClaim")


@pytest.mark.parametrize("values, message", [
    ({"workers": [{"workerType": "prefil", "model": {"name": "m"}}]}, "workerType"),
    ({"workers": [{"workerType": "prefill", "model": {"name": "m"}}]}, "no decode or both workers"),
    ({"workers": []}, "workers"),
    ({"workers": [{"model": {}}]}, "model"),
    ({"frontend": {"routerMode": "least-loaded"}}, "routerMode"),
    ({"keda": {"enabled": True}, "planner": {"enabled": True}}, "keda.enabled and planner.enabled"),
    ({"planner": {"enabled": True}, "workers": [{"name": "decodeworker1", "workerType": "decode",
                                                 "model": {"name": "m"}}]}, "leave workers[0].name empty"),
    ({"workers": [{"name": "a", "workerType": "both", "model": {"name": "m"}},
                  {"name": "a", "workerType": "both", "model": {"name": "m"}}]}, "used twice"),
    ({"redis": {"enabled": False}}, "redis.externalUrl"),
    ({"modelStorage": {"type": "existingClaim"}}, "modelStorage.existingClaim is required"),
    ({"workers": [{"workerType": "both", "gpuDevice": -1, "model": {"name": "m"}}]}, "gpuDevice"),
    ({"workers": [{"workerType": "both", "model": {"name": "m", "source": "builtin:x", "path": "/m"}}]}, "model"),
    ({"redis": {"ha": {"enabled": True, "externalSentinels": ["s:26379"]}}}, "redis.ha.externalSentinels is for"),
    ({"redis": {"enabled": False, "externalUrl": "redis://:p@h/0", "ha": {"enabled": True}}},
     "needs redis.ha.externalSentinels"),
    ({"redis": {"enabled": False, "externalUrl": "redis://:p@h/0",
                "ha": {"enabled": True, "externalSentinels": ["s:26379"]}}}, "quorum 2 is more than the 1"),
    ({"redis": {"ha": {"enabled": True, "quorum": 4}}}, "quorum 4 is more than the 3"),
    ({"redis": {"ha": {"enabled": True, "dataNodes": 1}}}, "dataNodes"),
    ({"redis": {"ha": {"externalSentinels": ["s0:26379,s1:26379"]}}}, "externalSentinels"),
    # the ops audit: gunicorn bound config.api.port while the Service and probes stayed on frontend.port
    ({"config": {"api": {"port": 9000}}}, "config.api.port is set by the chart"),
    ({"config": {"flower": {"host": "127.0.0.1"}}}, "config.flower.host is set by the chart"),
])
def test_invalid_values_fail_the_render(values, message):
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render_mod.render(values)


def test_render_cli_prints_every_manifest(capsys):
    assert render_mod.main(["-f", str(EXAMPLES / "values-gpu.yaml"), "--set", "frontend.replicas=3"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    api = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-api"))
    assert api["spec"]["replicas"] == 3
    assert render_mod.main(["--lint"]) == 0


@pytest.mark.parametrize("case", list(VALUE_SETS))
def test_workers_take_connections_from_workers_only(case):
    """The listeners audit: workers' KV-transfer port listens on 0.0.0.0 (decode workers on other nodes pull
    from it), and with no NetworkPolicy any pod of the cluster could hold its connection slots. The chart's
    policy selects every worker pod and lets in only this release's workers (its selector matches the worker
    Deployments' own pod labels); networkPolicy.enabled false leaves it out, workerIngressFrom adds peers."""
    objs = objects(case)
    policy = by_kind(objs, "NetworkPolicy")[f"{RELEASE}-inference-farm-workers"]
    sel = policy["spec"]["podSelector"]["matchLabels"]
    pods = [o["spec"]["template"]["metadata"]["labels"] for o, _ in pod_specs(objs)]
    worker_pods = [labels for labels in pods if labels.get("app.kubernetes.io/component") == "worker"]
    assert worker_pods and all(sel.items() <= labels.items() for labels in worker_pods)
    assert not any(sel.items() <= labels.items() for labels in pods if labels not in worker_pods)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": sel}}] and "ports" not in rule
    off = render_mod.manifests(render_mod.render({**VALUE_SETS[case], "networkPolicy": {"enabled": False}},
                                                 name=RELEASE, namespace=NAMESPACE))
    assert not by_kind(off, "NetworkPolicy")
    extra = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "debug"}}}
    more = render_mod.manifests(render_mod.render(
        {**VALUE_SETS[case], "networkPolicy": {"enabled": True, "workerIngressFrom": [extra]}},
        name=RELEASE, namespace=NAMESPACE))
    assert by_kind(more, "NetworkPolicy")[f"{RELEASE}-inference-farm-workers"]["spec"]["ingress"][0]["from"][1] == extra


def test_flower_takes_connections_from_its_namespace_only():
    """The ops audit: Flower's /metrics answers without a login, and the chart's Flower was reachable from any
    pod of the cluster. Its policy selects the Flower pod alone and lets in this namespace's pods, and the peers
    flowerIngressFrom adds (Prometheus' namespace)."""
    extra = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    objs = render_mod.manifests(render_mod.render({"flower": {"enabled": True},
                                                   "networkPolicy": {"flowerIngressFrom": [extra]}},
                                                  name=RELEASE, namespace=NAMESPACE))
    policy = by_kind(objs, "NetworkPolicy")[f"{RELEASE}-inference-farm-flower"]
    sel = policy["spec"]["podSelector"]["matchLabels"]
    pods = [o["spec"]["template"]["metadata"]["labels"] for o, _ in pod_specs(objs)]
    assert [labels["app.kubernetes.io/component"] for labels in pods if sel.items() <= labels.items()] == ["flower"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {}}, extra]}]
    off = render_mod.manifests(render_mod.render({"flower": {"enabled": False}}, name=RELEASE, namespace=NAMESPACE))
    assert f"{RELEASE}-inference-farm-flower" not in by_kind(off, "NetworkPolicy")
