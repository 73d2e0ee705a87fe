"""Actuators: how a replica count becomes workers, behind one small interface.

- LocalActuator: the `farm` supervisor on this machine (Farm.scale): new worker processes, or the
  newest retired with SIGTERM, Celery's warm shutdown: it stops taking tasks, finishes what it has, exits.
- KubernetesActuator: the `scale` subresource of each worker Deployment, through the API server with the
  pod's service-account token and CA (plain `requests`, no client library). Pods removed by a scale-down
  get SIGTERM too, so the same warm shutdown applies; give the pods a terminationGracePeriodSeconds
  longer than the longest request.
Dry run is not an actuator: the planner simply does not call `scale`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Protocol

import requests

from farm.config.planner import KubernetesConfig


class ActuatorError(RuntimeError):
    """A replica count could not be read or set; the message says where."""


class Actuator(Protocol):
    name: str

    def replicas(self, model: str, role: str) -> int:
        """Workers the actuator runs (or is starting) for the role; retiring ones do not count."""
        ...

    def scale(self, model: str, role: str, n: int) -> str:
        """Set the replica count; returns a short description of what changed."""
        ...


class LocalActuator:
    """Scales the worker processes of a Farm this process supervises."""

    name = "local"

    def __init__(self, farm):
        self.farm = farm

    def replicas(self, model: str, role: str) -> int:
        self.farm.reap_retired()
        return len(self.farm.workers(role, model))

    def scale(self, model: str, role: str, n: int) -> str:
        before = len(self.farm.workers(role, model))
        changed = self.farm.scale(role, n, model)
        verb = "started" if n > before else "retiring (warm shutdown)"
        return f"{verb} {', '.join(changed)}" if changed else "no change"

    def retiring(self) -> list[str]:
        return [p.name for p in self.farm.procs if p.retiring and p.alive()]


def deployment_name(template: str, model: str, role: str) -> str:
    """A DNS-1123 Deployment name from the template: lower case, [a-z0-9-], at most 63 characters."""
    slug = re.sub(r"[^a-z0-9-]+", "-", model.lower()).strip("-")
    name = re.sub(r"[^a-z0-9-]+", "-", template.format(model=slug, role=role).lower())
    return re.sub(r"-+", "-", name).strip("-")[:63].rstrip("-")


class KubernetesActuator:
    """PATCHes /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale with the service-account token."""

    name = "kubernetes"

    def __init__(self, cfg: KubernetesConfig, session: requests.Session | None = None,
                 environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.cfg = cfg
        self.base = cfg.api_server.rstrip("/") or self._in_cluster_url(env)
        self.namespace = cfg.namespace or self._read(cfg.namespace_path, "default").strip()
        self.session = session or requests.Session()

    @staticmethod
    def _in_cluster_url(env: Any) -> str:
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ActuatorError("not in a cluster (KUBERNETES_SERVICE_HOST unset) and planner.kubernetes."
                                "api_server is empty")
        return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"

    @staticmethod
    def _read(path: str, default: str | None = None) -> str:
        try:
            return Path(path).read_text()
        except OSError:
            if default is not None:
                return default
            raise ActuatorError(f"cannot read {path}") from None

    def url(self, model: str, role: str) -> str:
        name = deployment_name(self.cfg.deployment, model, role)
        return f"{self.base}/apis/apps/v1/namespaces/{self.namespace}/deployments/{name}/scale"

    def _request(self, method: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        # The token is read for every call: projected service-account tokens are rotated by the kubelet.
        headers = {"Authorization": f"Bearer {self._read(self.cfg.token_path).strip()}",
                   "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
        verify: bool | str = self.cfg.ca_path if Path(self.cfg.ca_path).exists() else True
        try:
            resp = self.session.request(method, url, json=body, headers=headers, verify=verify,
                                        timeout=self.cfg.timeout_s)
        except requests.RequestException as e:
            raise ActuatorError(f"{method} {url}: {e}") from e
        if not resp.ok:
            raise ActuatorError(f"{method} {url}: HTTP {resp.status_code} {resp.text[:300]}")
        return resp.json() if resp.content else {}

    def replicas(self, model: str, role: str) -> int:
        data = self._request("GET", self.url(model, role))
        return int((data.get("spec") or {}).get("replicas") or 0)

    def scale(self, model: str, role: str, n: int) -> str:
        data = self._request("PATCH", self.url(model, role), {"spec": {"replicas": int(n)}})
        got = (data.get("spec") or {}).get("replicas", n)
        return f"deployment {deployment_name(self.cfg.deployment, model, role)} replicas -> {got}"
