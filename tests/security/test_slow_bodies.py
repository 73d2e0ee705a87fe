"""Issue 26 item 2: slow request bodies stopped the API. 4,300 POSTs of one key announcing 1,000 bytes and
sending one every 10 s held every connection (api.worker_connections) for as long as they lasted:
/health/live and every chat timed out. `api.header_timeout_s` bounds only the request head.

Now (api/admission.py) a body must arrive within `api.body_timeout_s` (plus a second per `api.body_min_rate`
bytes received), else 408 and the connection is closed, for JSON (Content-Length or chunked) and multipart
uploads alike; and one key holds at most `api.limits.max_concurrent_requests` requests in progress per API
process, the rest refused at once with 429. The attack runs against the API as `farm up` serves it
(gunicorn's gevent worker) with small limits; the slot bookkeeping is also checked in-process."""

from __future__ import annotations

import io
import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests
from flask import Flask, Response

from api.admission import Admission, DeadlineInput, InFlight, admit
from api.error_handlers import register_error_handlers
from farm.supervisor import Farm
from tests.security.farms import MODEL, base_url, real_farm
from tests.security_helpers import KEY_A, KEY_B, assert_openai_error, bearer, farm_app

WORKER_CONNECTIONS = 64
BODY_TIMEOUT_S = 2
PER_KEY = 32
ATTACKERS = 80  # more than the API holds: without the per-key cap they would take every connection
TICK_S = 0.5  # the attackers send one body byte per tick


@pytest.fixture(scope="module")
def farm(redis_url, tmp_path_factory, real_model_dir) -> Iterator[Farm]:
    config = {"api": {"worker_connections": WORKER_CONNECTIONS, "header_timeout_s": 2, "body_timeout_s": BODY_TIMEOUT_S,
                      "body_min_rate": 16384, "limits": {"max_concurrent_requests": PER_KEY}},
              # not under test, and its warm-up (model loading on the hub) can stall the API for seconds after start
              "semantic": {"enabled": False}}
    with real_farm(redis_url, tmp_path_factory.mktemp("slow-bodies"), real_model_dir, config=config,
                   env={"FARM_API_KEYS": f"{KEY_A},{KEY_B}"}) as f:
        yield f


# -- the attack over real sockets ---------------------------------------------------------------------------
BOUNDARY = "slowbodyboundary"


def attack_head(port: int, kind: str) -> bytes:
    """The request head of one attacker: a JSON chat with Content-Length, a chunked JSON chat, or a multipart
    upload to /v1/files, each announcing a body it then sends a byte per tick."""
    path, ctype, framing = "/v1/chat/completions", "application/json", "Content-Length: 1000"
    if kind == "chunked":
        framing = "Transfer-Encoding: chunked"
    elif kind == "multipart":
        path, ctype = "/v1/files", f"multipart/form-data; boundary={BOUNDARY}"
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEY_A}\r\n"
            f"Content-Type: {ctype}\r\n{framing}\r\n\r\n").encode()


@dataclass
class Attacker:
    sock: socket.socket
    kind: str
    data: bytes = b""
    closed_at: float | None = None  # seconds after the attack began: EOF, reset, or a failed send
    sent: int = 0

    @property
    def status(self) -> int | None:
        line = self.data.split(b"\r\n", 1)[0].split()
        return int(line[1]) if len(line) > 1 and line[1].isdigit() else None

    def body(self) -> dict:
        return json.loads(self.data.split(b"\r\n\r\n", 1)[1])

    def header(self, name: str) -> str | None:
        for line in self.data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
            k, _, v = line.decode().partition(":")
            if k.strip().lower() == name.lower():
                return v.strip()
        return None


def body_byte(kind: str, sent: int) -> bytes:
    if kind == "chunked":
        return b"1\r\n{\r\n"
    if kind == "multipart" and sent == 0:
        return f"--{BOUNDARY}\r\n".encode()
    return b"{"


def run_attack(port: int, until_s: float) -> list[Attacker]:
    """Open ATTACKERS connections of key A, each sending a request head and then one body byte per tick,
    until every one was closed by the server or `until_s` passed."""
    kinds = ("json", "chunked", "multipart")
    conns = []
    for i in range(ATTACKERS):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        conns.append(Attacker(s, kinds[i % 3]))
    t0 = time.monotonic()
    sel = selectors.DefaultSelector()
    for a in conns:
        a.sock.sendall(attack_head(port, a.kind))
        a.sock.setblocking(False)
        sel.register(a.sock, selectors.EVENT_READ, a)
    next_tick = t0 + TICK_S
    try:
        while any(a.closed_at is None for a in conns) and time.monotonic() - t0 < until_s:
            for key, _ in sel.select(timeout=0.05):
                a = key.data
                try:
                    chunk = a.sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    a.data += chunk
                else:
                    a.closed_at = time.monotonic() - t0
                    sel.unregister(a.sock)
            if time.monotonic() >= next_tick:
                next_tick += TICK_S
                for a in conns:
                    if a.closed_at is None:
                        try:
                            a.sock.send(body_byte(a.kind, a.sent))
                            a.sent += 1
                        except BlockingIOError:
                            pass
                        except OSError:
                            a.closed_at = time.monotonic() - t0
                            sel.unregister(a.sock)
    finally:
        sel.close()
        for a in conns:
            a.sock.close()
    return conns


def fair_upload(port: int, size: int, parts: int, pause_s: float) -> tuple[int, dict]:
    """KEY_B uploads a `size`-byte batch file in `parts` pieces `pause_s` apart: slower in total than
    body_timeout_s, but well above body_min_rate."""
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}}) + "\n"
    content = (line * (size // len(line) + 1))[:size].rsplit("\n", 1)[0].encode() + b"\n"
    body = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"fair.jsonl\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode() + content + f"\r\n--{BOUNDARY}--\r\n".encode()

    def slowly() -> Iterator[bytes]:
        step = len(body) // parts + 1
        for i in range(0, len(body), step):
            yield body[i:i + step]
            time.sleep(pause_s)

    # a generator body goes out chunked, hence also exercises the chunked path of the multipart parser
    resp = requests.post(f"http://127.0.0.1:{port}/v1/files", data=slowly(), timeout=30,
                         headers={**bearer(KEY_B), "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    return resp.status_code, resp.json()


def test_slow_bodies_get_408_the_excess_429_and_others_are_served(farm):
    """80 connections of one key dribble their bodies (JSON with Content-Length, chunked JSON, multipart
    uploads) into an API that holds 64: 32 are admitted and answered 408 and closed once body_timeout_s
    passed, the other 48 get 429 at once and are closed; meanwhile /health/live, another key's requests and a
    large upload of that key that takes longer than body_timeout_s at a fair rate are all served."""
    url = base_url(farm)
    assert requests.get(url + "/health/live", timeout=10).status_code == 200
    result: dict = {}
    attack = threading.Thread(target=lambda: result.update(conns=run_attack(farm.api_port, BODY_TIMEOUT_S + 10)))
    attack.start()
    upload: dict = {}

    def upload_fairly() -> None:
        upload["status"], upload["meta"] = fair_upload(farm.api_port, 96 * 1024, 12, 0.25)

    uploader = threading.Thread(target=upload_fairly)
    try:
        time.sleep(0.5)  # every attacker's head is in
        uploader.start()
        started = time.monotonic()
        during = []
        while time.monotonic() - started < BODY_TIMEOUT_S - 0.5:
            t = time.monotonic()
            live = requests.get(url + "/health/live", timeout=10)
            models = requests.get(url + "/v1/models", headers=bearer(KEY_B), timeout=10)
            during.append((live.status_code, models.status_code, time.monotonic() - t))
            time.sleep(0.1)
        # a JSON body of the other key, read and parsed (a chat would load the tokenizer first: seconds of CPU)
        batch = requests.post(url + "/v1/batches", headers=bearer(KEY_B), timeout=10,
                              json={"input_file_id": "file-" + "0" * 24, "endpoint": "/v1/chat/completions",
                                    "completion_window": "24h"})
        uploader.join(30)
    finally:
        attack.join(BODY_TIMEOUT_S + 20)
    # the other key and the probes were served all along, promptly
    assert during and all((live, models) == (200, 200) for live, models, _ in during), during
    assert max(d for *_, d in during) < 3.0, during
    assert_openai_error_raw(batch.status_code, batch.json(), 404, "file_not_found")  # its body was read and parsed
    assert upload.get("status") == 200, upload  # 96 KiB in ~3 s: longer than body_timeout_s, at a fair rate
    assert upload["meta"]["bytes"] > 90 * 1024
    # the attackers: 32 admitted, each 408 once body_timeout_s passed and closed; the rest 429 at once, closed
    conns = result["conns"]
    assert all(a.closed_at is not None for a in conns), [a.status for a in conns if a.closed_at is None]
    by_status: dict = {}
    for a in conns:
        by_status.setdefault(a.status, []).append(a)
    assert sorted(by_status) == [408, 429], {k: len(v) for k, v in by_status.items()}
    assert len(by_status[408]) == PER_KEY and len(by_status[429]) == ATTACKERS - PER_KEY
    assert {a.kind for a in by_status[408]} == {"json", "chunked", "multipart"}
    for a in by_status[408]:
        assert BODY_TIMEOUT_S - 0.5 <= a.closed_at < BODY_TIMEOUT_S + 4, (a.kind, a.closed_at)
        assert_openai_error_raw(408, a.body(), 408, "request_timeout")
    for a in by_status[429]:
        assert a.closed_at < BODY_TIMEOUT_S, a.closed_at  # answered before any body deadline, and closed
        assert_openai_error_raw(429, a.body(), 429, "concurrency_limit_exceeded")
        assert a.header("Retry-After") == "1"
    # every slot was given back: the attacking key is served again, up to its full share
    held = [socket.create_connection(("127.0.0.1", farm.api_port), timeout=10) for _ in range(PER_KEY - 1)]
    try:
        for s in held:
            s.sendall(attack_head(farm.api_port, "json"))
        time.sleep(0.3)
        assert requests.get(url + "/v1/models", headers=bearer(KEY_A), timeout=10).status_code == 200
    finally:
        for s in held:  # clients that leave mid-body give their slots back too
            s.close()
    deadline = time.monotonic() + 5
    while requests.get(url + "/v1/models", headers=bearer(KEY_A), timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def assert_openai_error_raw(status: int, body: dict, want: int, code: str) -> None:
    assert status == want, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body


# -- in-process: the slot is given back however the response ends; the deadline without gevent -------------
def tiny_app(limit: int) -> Flask:
    app = Flask(__name__)
    register_error_handlers(app)
    app.extensions["farm_inflight"] = InFlight(limit)

    @app.before_request
    def _admit() -> None:
        admit("owner")

    @app.get("/stream")
    def stream():
        def gen() -> Iterator[bytes]:
            yield b"a"
            yield b"b"
        return Response(gen())

    @app.get("/broken-stream")
    def broken_stream():
        def gen() -> Iterator[bytes]:
            yield b"a"
            raise RuntimeError("the stream broke")
        return Response(gen())

    @app.get("/boom")
    def boom():
        raise RuntimeError("boom")

    app.wsgi_app = Admission(app.wsgi_app, 5, 0)
    return app


def test_a_slot_is_held_until_the_response_is_closed_whatever_ends_it():
    app = tiny_app(1)
    inflight: InFlight = app.extensions["farm_inflight"]
    c = app.test_client()
    resp = c.get("/stream")  # not read yet: a stream in progress
    assert inflight.count("owner") == 1
    refused = c.get("/stream")
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    refused.close()
    assert inflight.count("owner") == 1  # a refusal takes no slot
    assert resp.get_data() == b"ab"
    resp.close()  # the server closes the response after its last byte (or when the client left)
    assert inflight.count("owner") == 0
    broken = c.get("/broken-stream")
    with pytest.raises(RuntimeError):
        broken.get_data()
    broken.close()
    assert inflight.count("owner") == 0
    c.get("/boom").close()  # an error answered 500
    assert inflight.count("owner") == 0

    def raising(environ, start_response):  # an application that raises out of the WSGI call itself
        environ["farm.admission.release"] = inflight.acquire("owner")
        raise RuntimeError("raised")

    with pytest.raises(RuntimeError):
        Admission(raising, 5, 0)({}, lambda *a: None)
    assert inflight.count("owner") == 0
    release = inflight.acquire("owner")
    release()
    release()  # giving back twice counts once
    assert inflight.count("owner") == 0 and inflight.acquire("owner") is not None


class Trickle(io.BytesIO):
    """A request body that arrives one byte per `pause_s`."""

    def __init__(self, size: int, pause_s: float):
        super().__init__(b"{" * size)
        self.pause_s = pause_s

    def read(self, n: int | None = -1) -> bytes:
        time.sleep(self.pause_s)
        return super().read(1)


def test_the_body_deadline_holds_without_gevent_too(redis_url, tmp_path, redis_client):
    """Under the Flask test client (no gevent) the deadline is checked between reads: a body trickling in is
    408 after body_timeout_s; the same body at once is read whole. The per-key cap applies per key."""
    with farm_app(redis_url, tmp_path, FARM_API_KEYS=f"{KEY_A},{KEY_B}", FARM_API__BODY_TIMEOUT_S="1",
                  FARM_API__LIMITS__MAX_CONCURRENT_REQUESTS="1") as app:
        c = app.test_client()
        t = time.monotonic()
        resp = c.post("/v1/chat/completions", input_stream=Trickle(1000, 0.05),
                      content_type="application/json", headers=bearer(KEY_A))
        assert_openai_error(resp, 408, "request_timeout", "invalid_request_error")
        assert 1.0 <= time.monotonic() - t < 3
        resp.close()
        resp = c.post("/v1/chat/completions", data="[" * 40 + "]" * 40, content_type="application/json",
                      headers=bearer(KEY_A))
        assert_openai_error(resp, 400, "json_too_deep")  # read whole: the body's own error
        resp.close()
        held = c.get("/v1/models", headers=bearer(KEY_A))
        assert_openai_error(c.get("/v1/models", headers=bearer(KEY_A)), 429, "concurrency_limit_exceeded", "requests")
        assert c.get("/v1/models", headers=bearer(KEY_B)).status_code == 200
        held.close()
        assert c.get("/v1/models", headers=bearer(KEY_A)).status_code == 200


def test_a_fair_rate_earns_time_and_a_stall_does_not():
    """The deadline grows by a second per body_min_rate bytes received; no single wait exceeds body_timeout_s."""
    environ: dict = {}
    body = DeadlineInput(io.BytesIO(b"x" * 100), environ, timeout_s=1, min_rate=10, started=time.monotonic() - 0.5)
    assert body.read(50) == b"x" * 50  # 50 bytes at 10/s earned 5 s more: 6 s in all
    body.started -= 5  # 5.5 s in: still in time
    assert body.read(10) == b"x" * 10
    body.started -= 2  # 7.5 s in, 60 bytes earned 7 s: past it
    with pytest.raises(Exception) as e:
        body.read(10)
    assert getattr(e.value, "status", None) == 408 and environ["farm.admission.close"] is True
    stalled = DeadlineInput(io.BytesIO(b"x" * 100), {}, timeout_s=1, min_rate=10, started=time.monotonic())
    stalled.received = 10_000  # lots of credit, yet one wait is never longer than timeout_s
    assert 0 < stalled._wait_s() <= 1
