"""Kubernetes actuator against a real HTTPS server run here: token, CA verification, the scale PATCH.

The server is a small stand-in for the API server's `deployments/{name}/scale` subresource; it records
every request (method, path, headers, body), so the test checks the exact exchange on the wire.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from farm.cluster import registry
from farm.config.planner import Bounds, KubernetesConfig, LoadPolicyConfig, PlannerConfig
from farm.planner.actuators import ActuatorError, KubernetesActuator, deployment_name
from farm.planner.planner import Planner
from farm.planner.signals import RedisSignals

MODEL = "SmolLM2-135M-Instruct"


class FakeApiServer:
    """Deployments' replicas in a dict; answers GET and merge-PATCH on .../deployments/<name>/scale."""

    def __init__(self, cert: Path, key: Path, replicas: dict[str, int]):
        self.replicas = dict(replicas)
        self.requests: list[dict] = []
        self.fail_with: int | None = None
        srv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                srv.requests.append({"method": method, "path": self.path, "headers": dict(self.headers), "body": body})
                parts = self.path.strip("/").split("/")
                # apis/apps/v1/namespaces/<ns>/deployments/<name>/scale
                if srv.fail_with:
                    return self._answer(srv.fail_with, {"kind": "Status", "message": "forbidden"})
                if len(parts) != 8 or parts[:4] != ["apis", "apps", "v1", "namespaces"] or parts[7] != "scale":
                    return self._answer(404, {"message": "not found"})
                name = parts[6]
                if name not in srv.replicas:
                    return self._answer(404, {"message": f"deployments.apps {name!r} not found"})
                if method == "PATCH":
                    srv.replicas[name] = body["spec"]["replicas"]
                self._answer(200, {"kind": "Scale", "apiVersion": "autoscaling/v1",
                                   "metadata": {"name": name, "namespace": parts[4]},
                                   "spec": {"replicas": srv.replicas[name]}})

            def do_GET(self):  # noqa: N802
                self._handle("GET")

            def do_PATCH(self):  # noqa: N802
                self._handle("PATCH")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1: the server's certificate and the client's CA at once."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "ca.crt", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture
def api(tls):
    server = FakeApiServer(*tls, replicas={"farm-smollm2-135m-instruct-decode": 1,
                                           "farm-smollm2-135m-instruct-prefill": 1})
    yield server
    server.close()


@pytest.fixture
def sa(tmp_path, tls) -> KubernetesConfig:
    """Service-account files as mounted in a pod."""
    (tmp_path / "token").write_text("eyJ-test-token\n")
    (tmp_path / "namespace").write_text("inference\n")
    return KubernetesConfig(token_path=str(tmp_path / "token"), ca_path=str(tls[0]),
                            namespace_path=str(tmp_path / "namespace"))


def test_deployment_names_are_dns_labels():
    assert deployment_name("farm-{model}-{role}", MODEL, "decode") == "farm-smollm2-135m-instruct-decode"
    assert deployment_name("{model}_{role}", "org/Model.v2", "prefill") == "org-model-v2-prefill"


def test_scale_patches_the_deployment_with_the_service_account(api, sa):
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port)}
    act = KubernetesActuator(sa, environ=env)  # in-cluster: API server from the env, namespace from the file
    assert act.replicas(MODEL, "decode") == 1
    msg = act.scale(MODEL, "decode", 3)
    assert msg == "deployment farm-smollm2-135m-instruct-decode replicas -> 3"
    assert api.replicas["farm-smollm2-135m-instruct-decode"] == 3
    get, patch = api.requests
    assert get["method"] == "GET"
    assert patch["method"] == "PATCH"
    assert patch["path"] == "/apis/apps/v1/namespaces/inference/deployments/farm-smollm2-135m-instruct-decode/scale"
    assert patch["headers"]["Authorization"] == "Bearer eyJ-test-token"
    assert patch["headers"]["Content-Type"] == "application/merge-patch+json"
    assert patch["body"] == {"spec": {"replicas": 3}}
    assert act.replicas(MODEL, "decode") == 3


def test_errors_name_the_request(api, sa, tmp_path):
    act = KubernetesActuator(sa.model_copy(update={"api_server": f"https://127.0.0.1:{api.port}"}))
    with pytest.raises(ActuatorError, match="HTTP 404"):
        act.scale("other-model", "decode", 2)
    api.fail_with = 403
    with pytest.raises(ActuatorError, match="HTTP 403"):
        act.replicas(MODEL, "decode")
    other_ca = tmp_path / "other.crt"  # a CA that did not sign the server's certificate
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "k"),
                    "-out", str(other_ca), "-days", "1", "-subj", "/CN=other"], check=True, capture_output=True)
    strict = KubernetesActuator(sa.model_copy(update={"api_server": f"https://127.0.0.1:{api.port}",
                                                       "ca_path": str(other_ca)}))
    with pytest.raises(ActuatorError, match="SSL|certificate"):
        strict.replicas(MODEL, "decode")
    with pytest.raises(ActuatorError, match="KUBERNETES_SERVICE_HOST"):
        KubernetesActuator(sa, environ={})


def test_planner_scales_the_deployment_from_redis_load(api, sa, redis_client):
    """Real signals (a busy decode worker in Redis) -> load policy -> PATCH on the wire."""
    from farm.router.load import LoadTracker

    registry.register(redis_client, registry.WorkerInfo("decode-1@pod-a", "decode", MODEL, "pod-a", 1, 16))
    registry.heartbeat(redis_client, "decode-1@pod-a", {"running": 6, "waiting": 0, "blocks_total": 100,
                                                          "blocks_free": 60})
    loads = LoadTracker(redis_client)
    for i in range(6):
        loads.begin("d", "decode-1@pod-a", f"r{i}", 4)
    cfg = PlannerConfig(roles=["decode"], cooldown_up_s=0, bounds={"decode": Bounds(min=1, max=4)},
                        load=LoadPolicyConfig(decode_requests_per_worker=4),
                        kubernetes=sa.model_copy(update={"api_server": f"https://127.0.0.1:{api.port}"}))
    planner = Planner(cfg, RedisSignals(redis_client), KubernetesActuator(cfg.kubernetes), [MODEL], r=redis_client)
    (d,) = planner.step()
    assert (d.current, d.desired, d.target, d.action) == (1, 3, 3, "scale_up")
    assert d.applied == "deployment farm-smollm2-135m-instruct-decode replicas -> 3"
    assert api.requests[-1]["body"] == {"spec": {"replicas": 3}}
    state = json.loads(redis_client.get("farm:planner:state"))
    assert state["actuator"] == "kubernetes" and state["models"][MODEL]["decode"]["target"] == 3
