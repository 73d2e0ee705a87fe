#!/usr/bin/env python3
"""Writes the chart's values.schema.json: every key the chart knows, and no other (additionalProperties:
false on every object with named keys), so a typo in a values file fails `helm install` with the key's path
instead of being ignored. The farm's own settings under `config:` (and `planner.config`, and each worker's
`engine`) are checked against the farm's configuration model itself (farm.config.FarmConfig, as JSON schema),
so the chart rejects exactly what the farm would reject at start, minus what only the farm can check.

    python deploy/kubernetes/values_schema.py          # rewrite values.schema.json
    python deploy/kubernetes/values_schema.py --check  # exit 1 when the file is out of date

tests/test_deploy_helm.py fails when the file differs from what this writes (e.g. after a config change).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = Path(__file__).resolve().parent / "helm" / "inference-farm" / "values.schema.json"
sys.path.insert(0, str(ROOT))


def obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """An object with exactly these keys."""
    out: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": props}
    if required:
        out["required"] = required
    out.update(extra)
    return out


def string_map(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """A map of any keys to strings (labels, annotations, node selectors)."""
    return {"type": "object", "additionalProperties": values or {"type": "string"}}


INT = {"type": "integer"}
BOOL = {"type": "boolean"}
STR = {"type": "string"}
NONNEG = {"type": "integer", "minimum": 0}
POS = {"type": "integer", "minimum": 1}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
REF = "#/definitions/{}".format


def ttft_bucket_labels() -> tuple[str, ...]:
    """The `le` values of the farm's TTFT histogram (farm_ttft_seconds), as Prometheus writes them: the thresholds
    the chart's TTFT alert can use (metrics.prometheusRule.ttftSeconds)."""
    from prometheus_client.utils import floatToGoString

    from farm.telemetry.prometheus import TTFT_SECONDS

    return tuple(floatToGoString(b) for b in TTFT_SECONDS._upper_bounds if b != float("inf"))  # noqa: SLF001


TTFT_BUCKET_LABELS = ttft_bucket_labels()


def farm_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """FarmConfig's JSON schema for partial overrides: (the schema of `config:`, its definitions), with every
    key optional (the chart merges `config:` over what it computes) and refs renamed into `farm.*`."""
    from farm.config import FarmConfig

    raw = FarmConfig.model_json_schema()
    defs = raw.pop("$defs", {})

    def clean(node: Any) -> Any:
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if k in ("title", "required"):
                    continue
                if k == "$ref":
                    out[k] = REF("farm." + v.rsplit("/", 1)[1])
                elif k in ("properties", "$defs", "definitions"):
                    out[k] = {name: clean(sub) for name, sub in v.items()}
                else:
                    out[k] = clean(v)
            return out
        if isinstance(node, list):
            return [clean(x) for x in node]
        return node

    return clean(raw), {f"farm.{name}": clean(d) for name, d in defs.items()}


def chart_schema() -> dict[str, Any]:
    config, farm_defs = farm_schema()
    probe = obj({"periodSeconds": POS, "timeoutSeconds": POS, "failureThreshold": POS},
                ["periodSeconds", "timeoutSeconds", "failureThreshold"])
    quantity = {"type": ["string", "number"]}
    resources = obj({"requests": string_map(quantity), "limits": string_map(quantity),
                     "claims": {"type": "array", "items": obj({"name": STR, "request": STR}, ["name"])}})
    image = obj({"repository": {"type": "string", "minLength": 1}, "tag": {"type": ["string", "number"]},
                 "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}, ["repository", "tag"])
    # Kubernetes' own structures, passed through as they are: their first level is known here, the rest is
    # checked by the API server (strict field validation) when the chart is applied.
    toleration = obj({"key": STR, "operator": {"enum": ["Exists", "Equal"]}, "value": STR,
                      "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
                      "tolerationSeconds": INT})
    affinity = obj({"nodeAffinity": {"type": "object"}, "podAffinity": {"type": "object"},
                    "podAntiAffinity": {"type": "object"}})
    env = {"type": "array", "items": obj({"name": {"type": "string", "minLength": 1}, "value": STR,
                                          "valueFrom": {"type": "object"}}, ["name"])}
    placement = {"nodeSelector": string_map(), "tolerations": {"type": "array", "items": REF_("toleration")},
                 "affinity": REF_("affinity")}
    keda = {"enabled": BOOL, "minReplicas": NONNEG, "maxReplicas": POS, "targetWaiting": POS,
            "activationWaiting": NONNEG, "pollingInterval": POS, "cooldownPeriod": NONNEG,
            "scaleDownStabilizationSeconds": {"type": "integer", "minimum": 0, "maximum": 3600}}
    engine = {"$ref": REF("farm.EngineConfig")}
    model = obj({"name": {"type": "string", "pattern": "^[A-Za-z0-9._:/-]+$"},
                 "source": {"type": "string", "pattern": "^builtin:"}, "path": {"type": "string", "minLength": 1},
                 "maxModelLen": {"type": "integer", "minimum": 16}},
                **{"not": {"required": ["source", "path"]}, "anyOf": [{"required": ["name"]}, {"required": ["path"]}]})
    worker_entry = obj({
        "name": {"type": "string", "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$", "maxLength": 40},
        "workerType": {"enum": ["prefill", "decode", "both"]}, "replicas": NONNEG, "gpuDevice": NONNEG,
        "model": model, "resources": REF_("resources"), **placement, "engine": engine, "env": REF_("env"),
        "image": REF_("image"), "concurrency": POS, "keda": obj(keda),
    }, ["model"])
    service = obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}, "port": PORT,
                   "annotations": string_map()})
    storage_class = STR
    access_modes = {"type": "array", "items": {"enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany",
                                                         "ReadWriteOncePod"]}}
    props = {
        "nameOverride": STR, "fullnameOverride": STR,
        "images": obj({k: REF_("image") for k in ("api", "worker", "workerCuda", "prepare")}),
        "imagePullSecrets": {"type": "array", "items": obj({"name": STR}, ["name"])},
        "config": {"$ref": REF("farm.FarmConfig")},
        "defaultModel": STR,
        "frontend": obj({
            "replicas": NONNEG, "routerMode": {"enum": ["kv", "least-loaded", "round-robin", "random"]},
            "workerConnections": {"type": "integer", "minimum": 1, "maximum": 100000},
            "headerTimeoutSeconds": {"type": "integer", "minimum": 1, "maximum": 3600}, "port": PORT,
            "bodyTimeoutSeconds": {"type": "integer", "minimum": 1, "maximum": 3600}, "bodyMinRate": NONNEG,
            "gracefulTimeoutSeconds": NONNEG, "service": service, "resources": REF_("resources"), **placement,
            "podAnnotations": string_map(), "env": REF_("env"),
            "autoscaling": obj({"enabled": BOOL, "minReplicas": POS, "maxReplicas": POS,
                                "targetCPUUtilizationPercentage": {"type": "integer", "minimum": 1, "maximum": 100}}),
        }),
        "batchDriver": obj({"enabled": BOOL, "replicas": NONNEG, "concurrency": {"type": ["integer", "null"],
                                                                              "minimum": 1},
                            "terminationGracePeriodSeconds": NONNEG, "resources": REF_("resources"), **placement,
                            "podAnnotations": string_map(), "env": REF_("env")}),
        "worker": obj({"terminationGracePeriodSeconds": NONNEG, "concurrency": {"type": ["integer", "null"],
                                                                               "minimum": 1},
                       "startupProbe": REF_("probe"), "livenessProbe": REF_("probe"),
                       "readinessProbe": REF_("probe"), "resources": REF_("resources"), "gpuToleration": BOOL,
                       "podAnnotations": string_map()}),
        "workers": {"type": "array", "minItems": 1, "items": worker_entry},
        "modelStorage": obj({
            "type": {"enum": ["emptyDir", "persistentVolumeClaim", "existingClaim", "hostPath"]},
            "existingClaim": STR, "hostPath": STR,
            "persistentVolumeClaim": obj({"size": STR, "storageClass": storage_class, "accessModes": access_modes}),
            "prepare": obj({"enabled": BOOL, "resources": REF_("resources")}),
        }),
        "stateVolume": obj({"sizeLimit": {"type": ["string", "null"]}}),
        "redis": obj({
            "enabled": BOOL, "externalUrl": {"type": "string", "pattern": "^(rediss?://.*)?$"},
            "image": REF_("image"),
            "auth": obj({"password": {"type": "string", "pattern": "^[A-Za-z0-9]*$"}, "existingSecret": STR,
                         "existingSecretKey": {"type": "string", "minLength": 1}}),
            "appendfsync": {"enum": ["always", "everysec", "no"]},
            "persistence": obj({"enabled": BOOL, "size": STR, "storageClass": storage_class,
                                "accessModes": access_modes}),
            "resources": REF_("resources"), **placement,
            "ha": obj({
                "enabled": BOOL, "masterName": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,64}$"},
                "quorum": POS, "downAfterMilliseconds": {"type": "integer", "minimum": 100},
                "failoverTimeoutMilliseconds": {"type": "integer", "minimum": 1000}, "replicaAckTimeoutMs": NONNEG,
                "minReplicasMaxLagSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
                "dataNodes": {"type": "integer", "minimum": 2},
                "sentinel": obj({"replicas": POS, "port": PORT, "resources": REF_("resources"), **placement}),
                "externalSentinels": {"type": "array", "items": {"type": "string",
                                                                 "pattern": "^[^,:\\s]+:[0-9]{1,5}$|^\\[[0-9A-Fa-f:.]+\\]:[0-9]{1,5}$"}},
            }),
        }),
        "flower": obj({
            "enabled": BOOL, "port": PORT,
            # Flower reads "user:pass,more" as two logins: no comma in either part ("" = generated)
            "auth": obj({"username": {"type": "string", "pattern": "^[^:,]+$"},
                         "password": {"type": "string", "pattern": "^[^,]*$"},
                         "existingSecret": STR, "existingSecretKey": {"type": "string", "minLength": 1}}),
            "service": obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}, "port": PORT}),
            "resources": REF_("resources"), **placement,
        }),
        "planner": obj({
            "enabled": BOOL, "mode": {"enum": ["load", "sla"]}, "dryRun": BOOL,
            "intervalSeconds": {"type": "number", "exclusiveMinimum": 0},
            "config": {"$ref": REF("farm.PlannerConfig")}, "resources": REF_("resources"), **placement,
        }),
        "keda": obj({**{k: v for k, v in keda.items() if k != "enabled"}, "enabled": BOOL,
                     "prometheus": obj({"serverAddress": {"type": "string", "pattern": "^(https?://.+)?$"},
                                        "extraMatchers": STR})}),
        "secrets": obj({"farmSecret": STR, "apiKeys": {"type": "array", "items": {"type": "string",
                                                                                  "pattern": "^[^,]+$"}},
                        "metricsToken": STR, "existingSecret": STR}),
        "serviceAccount": obj({"create": BOOL, "name": STR, "annotations": string_map()}),
        "metrics": obj({"podAnnotations": BOOL, "driverPort": PORT,
                        "serviceMonitor": obj({"enabled": BOOL, "interval": {"type": "string", "pattern": "^[0-9]+[smh]$"},
                                               "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+[smh]$"},
                                               "labels": string_map()}),
                        "prometheusRule": obj({
                            "enabled": BOOL, "labels": string_map(),
                            # a bucket bound of farm_ttft_seconds, as Prometheus writes the `le` label
                            "ttftSeconds": {"enum": list(TTFT_BUCKET_LABELS)},
                            "ttftObjective": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                            "errorRatio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                            "waitingRequests": NONNEG})}),
        "podDisruptionBudget": obj({"enabled": BOOL, "maxUnavailable": {"type": ["integer", "string"]}}),
        "networkPolicy": obj({"enabled": BOOL, **{key: {"type": "array", "items": obj({
            "podSelector": {"type": "object"}, "namespaceSelector": {"type": "object"},
            "ipBlock": {"type": "object"}})} for key in ("workerIngressFrom", "flowerIngressFrom")}}),
        "topologySpread": obj({"enabled": BOOL, "maxSkew": POS, "topologyKey": {"type": "string", "minLength": 1},
                               "whenUnsatisfiable": {"enum": ["ScheduleAnyway", "DoNotSchedule"]}}),
        "podSecurityContext": {"type": "object"},
        "securityContext": {"type": "object"},
    }
    # the pod and container security contexts are Kubernetes' own, passed through whole
    props["podSecurityContext"] = obj({"runAsNonRoot": BOOL, "runAsUser": INT, "runAsGroup": INT, "fsGroup": INT,
                                       "fsGroupChangePolicy": STR, "supplementalGroups": {"type": "array"},
                                       "seccompProfile": {"type": "object"}, "seLinuxOptions": {"type": "object"},
                                       "sysctls": {"type": "array"}})
    props["securityContext"] = obj({"allowPrivilegeEscalation": BOOL, "readOnlyRootFilesystem": BOOL,
                                    "runAsNonRoot": BOOL, "runAsUser": INT, "runAsGroup": INT, "privileged": BOOL,
                                    "capabilities": obj({"add": {"type": "array"}, "drop": {"type": "array"}}),
                                    "seccompProfile": {"type": "object"}, "seLinuxOptions": {"type": "object"}})
    definitions = {"probe": probe, "resources": resources, "image": image, "toleration": toleration,
                   "affinity": affinity, "env": env, **farm_defs, "farm.FarmConfig": config}
    return {"$schema": "http://json-schema.org/draft-07/schema#", "title": "Inference Farm chart values",
            **obj(props), "definitions": definitions}


def REF_(name: str) -> dict[str, str]:  # noqa: N802 - reads as the $ref it is
    return {"$ref": REF(name)}


def render() -> str:
    return json.dumps(chart_schema(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when values.schema.json is out of date")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = SCHEMA_PATH.read_text() if SCHEMA_PATH.exists() else ""
        if current != text:
            print(f"{SCHEMA_PATH} is out of date: run python deploy/kubernetes/values_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
