"""A prompt classifier behind the Hugging Face text-classification shape (`{"inputs": text}` -> every label's score),
as a TEI or `transformers` pipeline server answers it: the tiny random-weight classifier of
bench.engine_speed.model, run by a real `transformers` pipeline on a local port. The remote guard's tests and the
live dashboard test ask it."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def pipeline_guard(classifier_dir: Path) -> Iterator[str]:
    """The classifier at `classifier_dir` served until the block ends; yields its /classify URL."""
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(classifier_dir), top_k=None, device="cpu")

    def app(environ, start_response):
        body = json.loads(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)))
        answer = json.dumps(classify(body["inputs"])).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(answer)))])
        return [answer]

    httpd = make_server("127.0.0.1", 0, app, handler_class=_Quiet)  # a free port, as the OS picks it
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}/classify"
    finally:
        httpd.shutdown()
