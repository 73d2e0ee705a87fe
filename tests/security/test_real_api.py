"""Attacks on the HTTP API over real sockets, against the API as `farm up` runs it (no workers, no keys):
the issue's DNS-rebinding curl (item 4), chunked bodies over the size limit (item 6), upload names with
CR/LF/NUL (item 7), client ids that name internal Redis keys (item 8), multi-megabyte prompts (item 9)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import requests

from farm.supervisor import Farm
from tests.security.farms import MODEL, api_process, base_url, real_farm

CHAT = "/v1/chat/completions"
LIMIT = 4 * 1024 * 1024  # api.max_body_bytes (default)


@pytest.fixture(scope="module")
def farm(redis_url, tmp_path_factory, real_model_dir) -> Iterator[Farm]:
    with real_farm(redis_url, tmp_path_factory.mktemp("real-api"), real_model_dir) as f:
        yield f


def chat_body(content: str, **extra) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}).encode()


def assert_error(status: int, body: bytes, want_status: int, code: str) -> dict:
    assert status == want_status, body[:300]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def raw_request(port: int, head: str, body_parts: list[bytes]) -> tuple[int, dict[str, str], bytes]:
    """Send `head` then `body_parts` on one connection while reading the answer (the server may answer
    and close before the whole body is sent); returns (status, headers, body)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)

    def send() -> None:
        try:
            sock.sendall(head.encode())
            for part in body_parts:
                sock.sendall(part)
        except OSError:  # the server answered and closed: the rest is not needed
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        sock.close()
        sender.join(10)


def chunked(body: bytes, size: int = 64 * 1024) -> list[bytes]:
    parts = [b"%x\r\n" % len(body[i:i + size]) + body[i:i + size] + b"\r\n" for i in range(0, len(body), size)]
    return [*parts, b"0\r\n\r\n"]


def post_chunked(farm: Farm, body: bytes, path: str = CHAT) -> tuple[int, dict[str, str], bytes]:
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{farm.api_port}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    return raw_request(farm.api_port, head, chunked(body))


# -- item 4: DNS rebinding and cross-site bodies ---------------------------------------------------------
def test_the_issues_rebinding_curl_is_refused(farm):
    """curl -H 'Host: rebind.attacker.example' -H 'Content-Type: text/plain' -d '{...}' answered 200."""
    url = base_url(farm) + CHAT
    body = chat_body("hi", max_tokens=5)
    resp = requests.post(url, data=body, headers={"Host": "rebind.attacker.example", "Content-Type": "text/plain"},
                         timeout=30)
    assert_error(resp.status_code, resp.content, 400, "invalid_host")
    resp = requests.post(url, data=body, headers={"Content-Type": "text/plain"}, timeout=30)
    assert_error(resp.status_code, resp.content, 415, "unsupported_media_type")
    resp = requests.post(url, data=body, headers={"Host": "rebind.attacker.example:8080",
                                                  "Content-Type": "application/json"}, timeout=30)
    assert_error(resp.status_code, resp.content, 400, "invalid_host")
    resp = requests.get(base_url(farm) + "/v1/models", headers={"Origin": "https://evil.example"}, timeout=30)
    assert resp.status_code == 200 and "access-control-allow-origin" not in {k.lower() for k in resp.headers}


# -- item 6: chunked bodies over the limit ----------------------------------------------------------------
@pytest.mark.parametrize("size", [int(4.21e6), 10_000_000])
def test_a_chunked_body_over_the_limit_is_413(farm, size):
    body = chat_body("x" * (size - len(chat_body(""))))
    assert len(body) == size > LIMIT
    status, _, raw = post_chunked(farm, body)
    assert_error(status, raw, 413, "request_too_large")


def test_a_chunked_body_under_the_limit_is_read_whole(farm):
    """Read to its end (a truncated body would be invalid JSON): a prompt that long is then refused for
    its length, which proves every byte arrived."""
    body = chat_body("y" * (LIMIT - 1024 - len(chat_body(""))))
    assert len(body) == LIMIT - 1024
    status, _, raw = post_chunked(farm, body)
    assert_error(status, raw, 400, "context_length_exceeded")
    small = chat_body("hello", max_tokens=3)  # a normal request sent chunked reaches the gateway (no workers)
    status, _, raw = post_chunked(farm, small)
    assert_error(status, raw, 503, "no_workers")


# -- item 7: upload names that break headers --------------------------------------------------------------
@pytest.mark.parametrize("path", [CHAT, "/v1/messages", "/v1/files"])
@pytest.mark.parametrize("body", [b"zz\r\nabc\r\n0\r\n\r\n", b"-5\r\nabcde\r\n0\r\n\r\n",
                                  b"3\r\nabcXX0\r\n\r\n"])
def test_a_malformed_chunked_body_is_a_400(farm, path, body):
    """A chunk size that is not hex, or a chunk without its CRLF: gunicorn's parse error reached the app's
    catch-all as a 500 `internal_error` (the fuzz audit); the client's malformed body is now a 400."""
    kind = "multipart/form-data; boundary=x" if path == "/v1/files" else "application/json"  # else a 415 first
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{farm.api_port}\r\nContent-Type: {kind}\r\n"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    status, _, answer = raw_request(farm.api_port, head, [body])
    assert status == 400, answer[:300]
    assert b"Traceback" not in answer and b"internal" not in answer


@pytest.mark.parametrize("disposition", [
    b"filename*=UTF-8''evil%0D%0ASet-Cookie%3A%20x%3D1.jsonl",  # CR LF: "Header values must not contain newlines"
    b"filename*=UTF-8''nul%00byte.jsonl",  # NUL: gunicorn's own HTML 500
    b'filename="raw\x00nul.jsonl"',
    b'filename="esc\x1b[31m\x7f.jsonl"',
])
def test_upload_names_with_control_characters_still_download(farm, disposition):
    content = b'{"custom_id": "a"}\n'
    boundary = "farmtestboundary7"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; ").encode() + disposition + (
            b"\r\nContent-Type: application/octet-stream\r\n\r\n") + content + f"\r\n--{boundary}--\r\n".encode()
    resp = requests.post(base_url(farm) + "/v1/files", data=body, timeout=30,
                         headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert resp.status_code == 200, resp.text
    meta = resp.json()
    assert not any(ord(c) < 32 or ord(c) == 127 for c in meta["filename"]), meta["filename"]
    got = requests.get(base_url(farm) + f"/v1/files/{meta['id']}/content", timeout=30)
    assert got.status_code == 200 and got.content == content
    disp = got.headers["Content-Disposition"]
    assert disp.startswith("attachment") and not any(ord(c) < 32 for c in disp)
    assert requests.get(base_url(farm) + f"/v1/files/{meta['id']}", timeout=30).json()["filename"] == meta["filename"]


# -- item 8: client ids that name internal keys -----------------------------------------------------------
@pytest.mark.parametrize("path", [
    "/v1/batches/seq", "/v1/batches/active", "/v1/batches/inflight",  # farm:batch:seq is a string key
    "/v1/batches/batch_" + "0" * 32 + ":results", "/v1/files/file-" + "0" * 24 + ":x",
    "/v1/files/seq", "/v1/files/seq/content", "/v1/batches/seq/cancel",
])
def test_ids_cannot_address_internal_keys(farm, redis_url, path):
    import redis

    redis.Redis.from_url(redis_url).incr("farm:batch:seq")  # as after any upload: a key of another type
    method = requests.post if path.endswith("/cancel") else requests.get
    resp = method(base_url(farm) + path, timeout=30)
    assert resp.status_code == 404, (path, resp.status_code, resp.text[:300])
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


# -- item 9: huge prompts ---------------------------------------------------------------------------------
def test_multi_megabyte_prompts_are_refused_before_tokenizing_and_memory_stays_flat(farm):
    """A 3.8 MB prompt took 10-14 s of API CPU and the API grew from 0.8 to 2.2 GB after ~8 of them."""
    url, body = base_url(farm) + CHAT, chat_body("lorem ipsum " * 316_000)
    assert 3.7e6 < len(body) < LIMIT
    proc = api_process(farm)
    resp = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=60)  # warm-up
    assert_error(resp.status_code, resp.content, 400, "context_length_exceeded")
    before = proc.memory_info().rss
    for _ in range(8):
        t0 = time.monotonic()
        resp = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=60)
        err = assert_error(resp.status_code, resp.content, 400, "context_length_exceeded")
        assert "characters" in err["message"] and err["param"] == "messages"
        assert time.monotonic() - t0 < 10  # generous on a busy box; tokenizing it took 10-14 s
    grown = proc.memory_info().rss - before
    assert grown < 200 * 1024 * 1024, f"the API grew by {grown / 2**20:.0f} MiB over 8 huge prompts"
