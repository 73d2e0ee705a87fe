"""Reading a JSON request body strictly: JSON media type, within the size limit, valid UTF-8, strict JSON
(no NaN/Infinity), bounded nesting.

Each failure is its own precise 4xx instead of a 500 (json's C parser raises RecursionError on very
deep input) or a silently accepted oddity:
- 415 unless `Content-Type` is JSON: a browser can send `text/plain` (or a form) cross-site without a
  CORS preflight, so a JSON endpoint that parsed those would be reachable from any web page.
- 413 past the route's limit (`api.max_body_bytes`), also for chunked bodies: werkzeug stops reading a
  body without Content-Length at the limit without saying so, which would run a truncated request.
- 408 when the body does not arrive in time (`api.body_timeout_s`): api/admission.py puts the deadline on
  `wsgi.input` itself, so it covers every read here and werkzeug's multipart parser alike.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from flask import request
from werkzeug.exceptions import RequestEntityTooLarge

from farm.openai.api_error import APIError, bad_request
from farm.protocol.jsonsafe import MAX_JSON_DEPTH, JSONTooDeep, loads_bounded

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a lone surrogate gets into valid UTF-8 JSON
_READ_CHUNK = 64 * 1024


def is_json_media_type(content_type: str | None) -> bool:
    """application/json, or any application/*+json, with or without parameters (charset)."""
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def require_json_media_type() -> None:
    if not is_json_media_type(request.content_type):
        got = request.content_type or "none"
        raise APIError(415, f"Unsupported Content-Type {got!r}: send the body as application/json.",
                       param="Content-Type", code="unsupported_media_type")
    require_identity_encoding()


def require_identity_encoding() -> None:
    """415 for a compressed (or otherwise encoded) body: the API reads bodies as sent, and gzip read as JSON was a
    misleading 400 "not valid UTF-8", an unknown coding silently ignored."""
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    if coding not in ("", "identity"):
        raise APIError(415, f"Unsupported Content-Encoding {coding[:64]!r}: send the body uncompressed.",
                       param="Content-Encoding", code="unsupported_media_type")


def require_multipart() -> None:
    """415 unless the body is multipart/form-data (a file upload), uncompressed."""
    if request.mimetype != "multipart/form-data":
        got = request.content_type or "none"
        raise APIError(415, f"Unsupported Content-Type {got!r}: upload the file as multipart/form-data.",
                       param="Content-Type", code="unsupported_media_type")
    require_identity_encoding()


def read_body() -> bytes:
    """The whole body, or 413 when it exceeds the route's limit, whether or not it came with a
    Content-Length (a chunked body over the limit is refused, never truncated)."""
    limit = request.max_content_length
    if limit is None or request.content_length is not None:  # werkzeug checks Content-Length itself
        return request.get_data(cache=True)
    stream = request.environ.get("wsgi.input")
    if stream is None or not request.environ.get("wsgi.input_terminated"):
        return request.get_data(cache=True)  # werkzeug's safe fallback: no length, no stream
    parts, size = [], 0
    while True:
        chunk = stream.read(min(_READ_CHUNK, limit + 1 - size))
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise RequestEntityTooLarge()
        parts.append(chunk)
    return b"".join(parts)


def parse_json(data: bytes) -> Any:
    """`data` as strict JSON, or a 400 saying exactly what is wrong with it."""
    if not data.strip():
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    try:
        body = loads_bounded(text, MAX_JSON_DEPTH)
    except JSONTooDeep:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                          code="json_too_deep") from None
    except ValueError as e:
        if "integer string conversion" in str(e):  # Python's own message would tell the client to call sys.*
            raise bad_request(f"the request body has a number of more than {sys.get_int_max_str_digits()} digits",
                              code="invalid_json") from None
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(text):  # an escaped pair is one character; a lone half is no text at all
        _refuse_lone_surrogates(body)
    return body


def _refuse_lone_surrogates(body: Any) -> None:
    """400 naming the first string that holds half a UTF-16 surrogate pair (`"\\ud800"`): valid JSON, but no
    tokenizer, Redis client or log line takes it, so it is refused here rather than failing deep inside as a 500."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict):
            for k, item in reversed(v.items()):
                stack.append((path, k))  # a key is text too
                stack.append((f"{path}.{k}" if path else str(k), item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(v))))
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                where = path or None
                raise bad_request(f"'{where or 'body'}' is not valid Unicode: a lone UTF-16 surrogate "
                                  f"(\\u{ord(v[e.start]):04x}) at character {e.start}", where, "invalid_value") from None


def json_body() -> Any:
    """This request's body as strict JSON: 415 unless sent as JSON, 413 when over the app's or
    blueprint's content length limit."""
    require_json_media_type()
    return parse_json(read_body())
