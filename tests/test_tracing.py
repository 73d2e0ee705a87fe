"""OpenTelemetry traces (farm.infra.tracing) and log correlation (farm.infra.logcontext).

An in-memory OTLP collector (an HTTP server in this process that decodes OTLP/HTTP protobuf with
opentelemetry-proto) receives the spans of a real disaggregated farm (gunicorn API, one prefill and one decode
worker on a tiny random model, a managed Redis): one streamed request is one trace across the three processes,
with the parent links and the order of the request's moments right. Off (no OTLP endpoint), nothing is installed.
Under gevent, two concurrent requests keep their own span and log fields.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import yaml

from farm.config import load_config
from farm.infra import logcontext, tracing
from farm.infra.logfiles import JsonFormatter
from tests.conftest import free_port, make_farm_env

ROOT = Path(__file__).resolve().parents[1]
OTEL_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME",
             "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER")


# -- the collector ---------------------------------------------------------------------------------------------
class Collector:
    """Accepts OTLP/HTTP protobuf on /v1/traces; keeps every span as a dict."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                    ExportTraceServiceResponse,
                )

                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                collector.add(req)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, req) -> None:
        def value(v):
            return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None

        for rs in req.resource_spans:
            resource = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    with self.lock:
                        self.spans.append({
                            "service": resource.get("service.name"), "resource": resource, "name": s.name,
                            "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "kind": s.kind, "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano, "attrs": {a.key: value(a.value) for a in s.attributes},
                            "events": {e.name: e.time_unix_nano for e in s.events}, "status": s.status.code})

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def stop(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.stop()


# -- off ---------------------------------------------------------------------------------------------------------
def test_off_without_an_endpoint_installs_nothing(monkeypatch):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not tracing.configured()
    assert tracing.setup("farm-api") is False
    assert tracing.ENABLED is False
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)  # the API's proxy/no-op provider
    assert tracing.start_span("x") is None and tracing.inject() is None and tracing.current_context() is None
    with tracing.span("x") as s:
        assert s is None
    assert tracing.trace_id() == ""
    # the standard switches keep it off even with an endpoint
    assert not tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"})
    assert not tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"})
    assert tracing.configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})


def test_json_lines_carry_request_fields_without_tracing():
    fmt = JsonFormatter()

    def line() -> dict:
        return json.loads(fmt.format(logging.LogRecord("farm.x", logging.INFO, __file__, 1, "hello", None, None)))

    def in_request() -> dict:
        logcontext.clear()
        logcontext.bind(request_id="chatcmpl-1", model="m", worker="decode-1@h")
        return line()

    import contextvars

    def outside() -> None:
        logcontext.clear()  # what an earlier test of this process (another module's, under xdist) left bound here
        out = contextvars.copy_context().run(in_request)
        assert out["request_id"] == "chatcmpl-1" and out["model"] == "m" and out["worker"] == "decode-1@h"
        assert "trace_id" not in out
        assert "request_id" not in line()  # bound in another context only

    contextvars.copy_context().run(outside)


def test_a_served_request_leaves_no_log_fields_behind():
    """A keep-alive greenlet's lines after a request (or after one that raised) are not that request's."""
    from api.request_tracing import RequestTracing

    def app(environ, start_response):
        logcontext.bind(request_id=environ["PATH_INFO"].strip("/"), model="m")
        if environ["PATH_INFO"] == "/boom":
            raise RuntimeError("boom")
        start_response("200 OK", [("Content-Type", "text/plain")])
        return (b"x" for _ in range(2))

    import contextvars

    def serve() -> None:
        wrapped = RequestTracing(app)
        body = wrapped({"PATH_INFO": "/chatcmpl-7", "REQUEST_METHOD": "GET"}, lambda *a: None)
        assert b"".join(body) == b"xx" and logcontext.fields().get("request_id") == "chatcmpl-7"  # while served
        body.close()
        assert "request_id" not in logcontext.fields() and "model" not in logcontext.fields()
        with pytest.raises(RuntimeError):
            wrapped({"PATH_INFO": "/boom", "REQUEST_METHOD": "GET"}, lambda *a: None)
        assert "request_id" not in logcontext.fields()

    if tracing.ENABLED:
        pytest.fail("this process has tracing on: the test checks the wrapper with it off")
    contextvars.copy_context().run(serve)


# -- gevent: two requests at once keep their own context --------------------------------------------------------
GEVENT_SCRIPT = textwrap.dedent("""
    from gevent import monkey
    monkey.patch_all()
    import json, sys, urllib.request
    import gevent
    from gevent.pywsgi import WSGIServer
    from farm.infra import logcontext, tracing
    from api.request_tracing import RequestTracing

    assert tracing.setup("farm-api")

    def app(environ, start_response):
        rid = environ["PATH_INFO"].strip("/")
        logcontext.bind(request_id=rid)
        tid = tracing.trace_id()
        start_response("200 OK", [("Content-Type", "text/plain")])

        def body():
            for i in range(5):
                gevent.sleep(0.02)  # the other request runs meanwhile
                with tracing.span("inner", attributes={"rid": rid}):
                    same = logcontext.fields().get("request_id") == rid and tracing.trace_id() == tid != ""
                yield b"ok " if same else b"MIXED "
        return body()

    server = WSGIServer(("127.0.0.1", 0), RequestTracing(app), log=None)
    server.start()
    url = f"http://127.0.0.1:{server.server_port}/"
    jobs = [gevent.spawn(lambda r=r: urllib.request.urlopen(url + r).read().decode()) for r in ("a", "b")]
    gevent.joinall(jobs, raise_error=True)
    tracing.flush()
    print(json.dumps([j.value for j in jobs]))
""")


def test_gevent_requests_keep_their_own_context(collector):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_SERVICE_NAME": "gevent-check",
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", GEVENT_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["ok " * 5] * 2
    spans = [s for s in collector.spans if s["service"] == "gevent-check"]
    servers = {s["attrs"]["url.path"]: s for s in spans if s["name"] == "GET"}
    assert set(servers) == {"/a", "/b"} and servers["/a"]["trace_id"] != servers["/b"]["trace_id"]
    for s in (s for s in spans if s["name"] == "inner"):
        own = servers["/" + s["attrs"]["rid"]]
        assert (s["trace_id"], s["parent"]) == (own["trace_id"], own["span_id"])


# -- a real disaggregated farm ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def farm(tmp_path_factory, tiny_model_dir, collector):
    from farm.supervisor import Farm

    tmp = tmp_path_factory.mktemp("tracing")
    env = make_farm_env(f"redis://127.0.0.1:{free_port()}/0", tmp)  # Farm starts and manages this Redis
    cfg0 = load_config(environ={})
    conf = tmp / "tiny.yaml"
    conf.write_text(yaml.safe_dump({"models": [{"name": cfg0.default_model, "path": str(tiny_model_dir),
                                                "max_model_len": 1024}]}))
    env.update({
        "FARM_CONFIG": str(conf),
        "FARM_DISAGGREGATION__MODE": "always",  # the prefill worker computes the prompt, the decode worker pulls
        "FARM_SEMANTIC__ENABLED": "false",  # no embedder to load: a faster start
        "FARM_LOGS__FORMAT": "json",
        "FARM_ENGINE__TORCH_THREADS": "1",
        "FARM_ENGINE__KV_CACHE_MB": "32",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s of a span's end
    })
    cfg = load_config(environ=env)
    with Farm(cfg, prefill=1, decode=1, both=0, port=free_port(), flower=False, env=env,
              grace_s=5).running(120) as f:
        yield f


def wait_for(collector: Collector, trace_id: str, names: set[str], timeout: float = 20) -> list[dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        spans = collector.trace(trace_id)
        if names <= {s["name"] for s in spans}:
            return spans
        time.sleep(0.1)
    raise AssertionError(f"missing spans {names - {s['name'] for s in collector.trace(trace_id)}}")


def api_trace(farm, collector) -> tuple[dict, list[dict]]:
    """One streamed completion; its API span and every span of its trace."""
    t0 = time.time_ns()
    try:
        resp = requests.post(f"http://127.0.0.1:{farm.api_port}/v1/completions", stream=True, timeout=60, json={
            "model": farm.cfg.default_model, "prompt": "Say hello to the farm, please.", "max_tokens": 6,
            "temperature": 0, "stream": True})
        assert resp.status_code == 200, resp.text
        assert b"data: [DONE]" in resp.content
    except (AssertionError, requests.RequestException) as e:
        tails = "\n".join(f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                          for p in sorted(farm.log_dir.glob("*.log")))
        raise AssertionError(f"{e}\n{tails}") from e
    deadline = time.time() + 20
    while time.time() < deadline:
        with collector.lock:
            api = [s for s in collector.spans if s["service"] == "farm-api" and s["start"] >= t0
                   and s["name"] == "POST /v1/completions"]
        if api:
            break
        time.sleep(0.1)
    assert api, "no API span exported"
    names = {"farm.place", "farm.prefill publish", "farm.prefill", "farm.admit", "farm.engine", "farm.kv.handover",
             "farm.decode publish", "farm.decode", "farm.kv.pull"}
    spans = wait_for(collector, api[0]["trace_id"], names)
    deadline = time.time() + 10  # both engine spans (prefill's and decode's)
    while sum(s["name"] == "farm.engine" for s in spans) < 2 and time.time() < deadline:
        time.sleep(0.1)
        spans = collector.trace(api[0]["trace_id"])
    return api[0], spans


def test_a_disaggregated_request_is_one_trace(farm, collector):
    api, spans = api_trace(farm, collector)
    by = {}
    for s in spans:
        key = s["name"] if s["name"] != "farm.engine" and s["name"] != "farm.admit" \
            else f"{s['name']}:{s['attrs'].get('farm.role') or s['attrs'].get('farm.stage')}"
        by[key] = s
    assert {"farm.engine:prefill", "farm.engine:decode", "farm.admit:prefill", "farm.admit:decode"} <= set(by)

    # one trace, three processes: the API and the two workers
    assert {s["trace_id"] for s in spans} == {api["trace_id"]}
    assert api["service"] == "farm-api" and api["parent"] == ""
    prefill_w, decode_w = by["farm.prefill"]["resource"], by["farm.decode"]["resource"]
    assert prefill_w["service.name"] == decode_w["service.name"] == "farm-worker"
    assert prefill_w["farm.role"] == "prefill" and decode_w["farm.role"] == "decode"
    assert prefill_w["farm.worker"] != decode_w["farm.worker"]

    # parent links: API -> placement -> publish -> prefill task -> engine -> hand-over -> publish -> decode task
    chain = [("farm.place", api), ("farm.prefill publish", by["farm.place"]),
             ("farm.prefill", by["farm.prefill publish"]), ("farm.admit:prefill", by["farm.prefill"]),
             ("farm.engine:prefill", by["farm.prefill"]), ("farm.kv.handover", by["farm.engine:prefill"]),
             ("farm.decode publish", by["farm.kv.handover"]), ("farm.decode", by["farm.decode publish"]),
             ("farm.admit:decode", by["farm.decode"]), ("farm.kv.pull", by["farm.decode"]),
             ("farm.engine:decode", by["farm.decode"])]
    for child, parent in chain:
        assert by[child]["parent"] == parent["span_id"], (child, parent["name"])

    # attributes that say what happened
    rid = api["attrs"]["farm.request_id"]
    assert api["attrs"]["http.response.status_code"] == 200 and api["attrs"]["http.route"] == "/v1/completions"
    assert api["attrs"]["farm.model"] == farm.cfg.default_model
    assert by["farm.place"]["attrs"]["farm.layout"] == "disaggregated"
    assert by["farm.place"]["attrs"]["farm.prefill_worker"] == prefill_w["farm.worker"]
    assert by["farm.place"]["attrs"]["farm.decode_worker"] == decode_w["farm.worker"]
    for name in ("farm.prefill", "farm.decode", "farm.engine:prefill", "farm.engine:decode", "farm.kv.pull"):
        assert by[name]["attrs"]["farm.request_id"] == rid, name
    assert by["farm.engine:prefill"]["attrs"]["farm.finish_reason"] == "prefilled"
    assert by["farm.engine:decode"]["attrs"]["farm.completion_tokens"] > 0
    assert by["farm.kv.pull"]["attrs"]["farm.kv.blocks"] > 0 and by["farm.kv.pull"]["attrs"].get("farm.kv.transport")

    # the order of the request's moments: the API first, prefill before the pull before decode's first token,
    # and the API's span covers the whole stream
    decode_first = by["farm.engine:decode"]["events"]["first_token"]
    assert api["start"] <= by["farm.place"]["start"] <= by["farm.prefill"]["start"]
    assert by["farm.prefill"]["start"] <= by["farm.engine:prefill"]["start"] <= by["farm.engine:prefill"]["end"]
    assert by["farm.engine:prefill"]["end"] <= by["farm.kv.pull"]["start"] <= by["farm.kv.pull"]["end"]
    assert by["farm.kv.pull"]["end"] <= by["farm.engine:decode"]["start"] <= decode_first
    assert by["farm.engine:decode"]["end"] <= api["end"]


def test_json_log_lines_carry_request_model_worker_and_trace_id(farm, collector):
    api, spans = api_trace(farm, collector)
    rid, tid = api["attrs"]["farm.request_id"], api["trace_id"]
    decode_worker = next(s for s in spans if s["name"] == "farm.decode")["resource"]["farm.worker"]
    lines: dict[str, list[dict]] = {}
    deadline = time.time() + 10
    while time.time() < deadline:
        lines = {}
        for path in farm.log_dir.glob("*.log"):
            for raw in path.read_text(errors="replace").splitlines():
                if raw.startswith("{") and tid in raw:
                    lines.setdefault(path.stem, []).append(json.loads(raw))
        if "api" in lines and any(any(x.get("worker") == decode_worker for x in v) for v in lines.values()):
            break
        time.sleep(0.2)
    # the API's access line of the request, and the decode worker's line of its task
    api_line = lines["api"][-1]
    assert (api_line["request_id"], api_line["model"], api_line["trace_id"]) == (rid, farm.cfg.default_model, tid)
    assert decode_worker in api_line["worker"]
    worker_lines = [x for v in lines.values() for x in v if x.get("worker") == decode_worker]
    assert worker_lines, lines
    assert all(x["request_id"] == rid and x["model"] == farm.cfg.default_model for x in worker_lines)
