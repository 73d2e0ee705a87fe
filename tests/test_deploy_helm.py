"""The Helm chart (deploy/kubernetes/helm/inference-farm), rendered and linted by Helm's own Go engine.

helm-python-sdk binds Helm's Go SDK (v4) in a shared library shipped in its wheel, so the templates,
values.schema.json, `fail`/`required` and Sprig behave as with `helm template` / `helm lint --strict`.
Every rendered object is validated against the Kubernetes OpenAPI schemas bundled in
kubernetes-validate (strict: unknown fields fail) for the oldest and newest Kubernetes the chart
supports; KEDA objects against the fields of KEDA's CRDs. Then the farm itself checks what the chart
hands it: the ConfigMap and the pods' FARM_* environment load with farm.config.load_config, worker
and planner commands parse with the `farm` CLI's own parser, the planner finds the worker Deployments,
KEDA watches the queues the workers consume, and the worker liveness probe is run against a real Redis.
Offline, no cluster, no helm binary.
"""

from __future__ import annotations

import base64
import importlib.util
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

from farm import registry
from farm.cli import build_parser
from farm.config import load_config
from farm.planner.actuators import deployment_name
from farm.planner.config import load_planner_config
from farm.protocol import queues_for_role

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("farm_deploy_render", ROOT / "deploy" / "kubernetes" / "render.py")
render_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_mod)

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
        "keda": {"enabled": True, "redisAddress": "redis.example:6379",
                 "passwordSecret": {"name": "external-redis", "key": "password"}},
        "workers": [{"name": "agg", "workerType": "both", "model": {"name": "SmolLM2-135M-Instruct"},
                     "keda": {"maxReplicas": 3}}],
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
# The fields of KEDA's ScaledObject CRD (keda.sh/v1alpha1) the chart may use, and the redis scaler's
# metadata keys; KEDA's CRD types trigger metadata as map[string]string.
_REDIS_SCALER_KEYS = ["address", "host", "port", "listName", "listLength", "activationListLength",
                      "databaseIndex", "enableTLS", "unsafeSsl", "usernameFromEnv", "passwordFromEnv"]
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
                    "type": {"const": "redis"}, "name": {"type": "string"},
                    "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                    "useCachedMetrics": {"type": "boolean"},
                    "metadata": {"type": "object", "additionalProperties": False, "required": ["listName"],
                                 "properties": {k: {"type": "string"} for k in _REDIS_SCALER_KEYS}},
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


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_manifests_match_kubernetes_schemas(case):
    errors = []
    for o in objects(case):
        where = f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"
        if o.get("apiVersion", "").startswith("keda.sh/"):
            schema = {"ScaledObject": _KEDA_SCALED_OBJECT, "TriggerAuthentication": _KEDA_TRIGGER_AUTH}[o["kind"]]
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
    auths = set(by_kind(objs, "TriggerAuthentication"))
    for name, so in by_kind(objs, "ScaledObject").items():
        assert so["spec"]["scaleTargetRef"]["name"] in deployments, name
        for t in so["spec"]["triggers"]:
            assert ("authenticationRef" in t) == bool(auths), name
            if auths:
                assert t["authenticationRef"]["name"] in auths, name
    for name, ta in by_kind(objs, "TriggerAuthentication").items():
        for ref in ta["spec"]["secretTargetRef"]:
            assert ref["name"] in external or ref["key"] in secrets.get(ref["name"], set()), f"{name}: {ref}"
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
    farm_containers = [(o, c) for o, pod in pod_specs(objs) if component(o) != "redis"
                       for c in pod.get("initContainers", []) + pod["containers"]]
    assert farm_containers
    for owner, c in farm_containers:
        env = resolved_env(c, objs)
        env["FARM_CONFIG"] = str(cfg_path)  # the mounted ConfigMap, here
        assert c["env"][0]["name"] == "FARM_CONFIG" or c["name"] == "worker"
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
                "pw@" if case == "external-redis" else env["REDIS_PASSWORD"] + "@"))
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
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
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
    worker's heartbeat key (written by farm.registry every 2 s, TTL 6 s) exists."""
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


def test_keda_scales_workers_on_their_own_queues():
    for case in ("aggregated-keda", "external-redis"):
        objs = objects(case)
        deps = workers(objs)
        sos = by_kind(objs, "ScaledObject")
        assert set(sos) == set(deps)
        for name, so in sos.items():
            c = container(deps[name]["spec"]["template"]["spec"], "worker")
            args = build_parser().parse_args(expand(c["command"][1:], resolved_env(c)))
            lists = [t["metadata"]["listName"] for t in so["spec"]["triggers"]]
            assert lists == queues_for_role(args.model, args.role)
            for t in so["spec"]["triggers"]:
                assert all(isinstance(v, str) for v in t["metadata"].values())
            address = so["spec"]["triggers"][0]["metadata"]["address"]
            if case == "aggregated-keda":
                assert address == f"{RELEASE}-inference-farm-redis.{NAMESPACE}.svc:6379"
                assert f"{RELEASE}-inference-farm-redis" in by_kind(objs, "Service")
            else:
                assert address == "redis.example:6379"
        assert so["spec"]["maxReplicaCount"] == (8 if case == "aggregated-keda" else 3)


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
    assert data == {"farm-secret": "s3cret", "api-keys": "k1,k2", "redis-url": "redis://:pw@redis.example:6379/0"}
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
