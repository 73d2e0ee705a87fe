"""A client's own id for its request (the X-Request-Id header, as vLLM takes it), and the id an answer carries.

Used when it is 1-128 of CLIENT_REQUEST_ID's characters, else ignored (a fresh id, as without one). A generated
answer's ids are api.routes.openai's RequestIds; an error answer carries `error_request_id`, so an SDK's error
object names the request too (the openai SDK reads `x-request-id`, Anthropic's `request-id`).
"""

from __future__ import annotations

import re
import uuid

CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def client_request_id(header: str | None) -> str | None:
    """The client's id when it sent a usable one."""
    return header if header is not None and CLIENT_REQUEST_ID.fullmatch(header) else None


def error_request_id(header: str | None) -> str:
    """An error answer's request id: the client's own, else a fresh `req_<hex>`."""
    return client_request_id(header) or f"req_{uuid.uuid4().hex}"
