"""`farm batch ...`: the Batch API from the terminal, through the farm's own HTTP API.

    farm batch submit FILE.jsonl [--endpoint /v1/chat/completions] [--metadata k=v ...] [--wait]
    farm batch status ID            (a live progress bar until the batch ends; --once for one line)
    farm batch results ID [-o OUT.jsonl] [--errors ERR.jsonl]

It talks HTTP like any client would (so it works against a farm on another machine with `--url`), and
sends `$FARM_API_KEY` (else `$OPENAI_API_KEY`) as the bearer token when set; without `--url` it talks to
`$OPENAI_BASE_URL` when set, as the OpenAI SDK does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import requests

from farm.config import FarmConfig

FINAL = {"completed", "failed", "cancelled", "expired"}


class BatchClient:
    """The few Batch API calls the CLI needs; errors come back as the API's own message."""

    def __init__(self, base_url: str, api_key: str = "", timeout: float = 60.0):
        self.base = base_url.rstrip("/")
        self.s = requests.Session()
        if api_key:
            self.s.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def _call(self, method: str, path: str, **kw: Any) -> requests.Response:
        try:
            r = self.s.request(method, self.base + path, timeout=self.timeout, **kw)
        except requests.ConnectionError:
            raise SystemExit(f"farm batch: no API at {self.base} (is the farm up? see --url)") from None
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text[:200]
            raise SystemExit(f"farm batch: {method} {path}: HTTP {r.status_code}: {msg}")
        return r

    def upload(self, path: Path) -> dict[str, Any]:
        with path.open("rb") as f:
            return self._call("POST", "/v1/files", data={"purpose": "batch"},
                              files={"file": (path.name, f, "application/jsonl")}).json()

    def create(self, file_id: str, endpoint: str, metadata: dict[str, str] | None) -> dict[str, Any]:
        body: dict[str, Any] = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"}
        if metadata:
            body["metadata"] = metadata
        return self._call("POST", "/v1/batches", json=body).json()

    def get(self, batch_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/batches/{batch_id}").json()

    def content(self, file_id: str) -> bytes:
        return self._call("GET", f"/v1/files/{file_id}/content").content


def progress_line(b: dict[str, Any], width: int = 30) -> str:
    """`[#####.....]  12/40 done, 1 failed  in_progress` for one batch object."""
    c = b.get("request_counts") or {}
    total, done, failed = int(c.get("total") or 0), int(c.get("completed") or 0), int(c.get("failed") or 0)
    filled = int(width * (done + failed) / total) if total else 0
    return (f"[{'#' * filled}{'.' * (width - filled)}] {done + failed:>{len(str(total))}}/{total} done, "
            f"{failed} failed  {b.get('status')}")


def _client(cfg: FarmConfig, args: argparse.Namespace) -> BatchClient:
    """--url, else $OPENAI_BASE_URL (as the OpenAI SDK reads it, `.../v1`), else this farm's API; the key from
    $FARM_API_KEY, else $OPENAI_API_KEY."""
    base = os.environ.get("OPENAI_BASE_URL", "").rstrip("/")
    base = base[: -len("/v1")] if base.endswith("/v1") else base
    url = args.url or base or \
        f"http://{'127.0.0.1' if cfg.api.host in ('0.0.0.0', '::') else cfg.api.host}:{cfg.api.port}"
    return BatchClient(url, os.environ.get("FARM_API_KEY") or os.environ.get("OPENAI_API_KEY", ""))


def cmd_submit(cfg: FarmConfig, args: argparse.Namespace) -> int:
    client = _client(cfg, args)
    path = Path(args.file)
    if not path.is_file():
        print(f"farm batch: no such file: {path}", file=sys.stderr)
        return 2
    meta = dict(kv.split("=", 1) for kv in args.metadata or [] if "=" in kv)
    f = client.upload(path)
    b = client.create(f["id"], args.endpoint, meta)
    print(b["id"])
    if args.wait:
        return _watch(client, b["id"])
    return 0


def _watch(client: BatchClient, batch_id: str, interval: float = 1.0) -> int:
    tty = sys.stdout.isatty()
    while True:
        b = client.get(batch_id)
        line = progress_line(b)
        print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)
        if b["status"] in FINAL:
            if tty:
                print()
            for e in ((b.get("errors") or {}).get("data") or [])[:20]:
                print(f"  line {e.get('line')}: {e.get('code')}: {e.get('message')}")
            return 0 if b["status"] == "completed" else 1
        time.sleep(interval)


def cmd_status(cfg: FarmConfig, args: argparse.Namespace) -> int:
    client = _client(cfg, args)
    if args.once or args.json:
        b = client.get(args.id)
        print(json.dumps(b, indent=2) if args.json else progress_line(b))
        return 0
    return _watch(client, args.id)


def cmd_results(cfg: FarmConfig, args: argparse.Namespace) -> int:
    client = _client(cfg, args)
    b = client.get(args.id)
    if b["status"] not in FINAL:
        print(f"farm batch: {args.id} is still {b['status']} ({progress_line(b)})", file=sys.stderr)
        return 1
    for file_id, dest, what in ((b.get("output_file_id"), args.output, "output"),
                                (b.get("error_file_id"), args.errors, "errors")):
        if not file_id:
            continue
        data = client.content(file_id)
        if dest:
            Path(dest).write_bytes(data)
            print(f"{what}: {len(data.splitlines())} lines -> {dest}", file=sys.stderr)
        elif what == "output":
            sys.stdout.buffer.write(data)
        else:
            sys.stderr.buffer.write(data)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="submit an OpenAI batch file, watch it, fetch its results")
    p.add_argument("--url", help="the farm's API (default: http://<api.host>:<api.port>)")
    bsub = p.add_subparsers(dest="batch_command", metavar="ACTION", required=True)

    s = bsub.add_parser("submit", help="upload FILE.jsonl and start a batch; prints the batch id")
    s.add_argument("file")
    s.add_argument("--endpoint", default="/v1/chat/completions", choices=("/v1/chat/completions", "/v1/completions"))
    s.add_argument("--metadata", nargs="*", metavar="KEY=VALUE")
    s.add_argument("--wait", action="store_true", help="then show progress until the batch ends")
    s.set_defaults(func=cmd_submit)

    st = bsub.add_parser("status", help="a live progress bar until the batch ends")
    st.add_argument("id")
    st.add_argument("--once", action="store_true", help="print one line and return")
    st.add_argument("--json", action="store_true", help="print the batch object")
    st.set_defaults(func=cmd_status)

    r = bsub.add_parser("results", help="the output lines (stdout) and error lines (stderr) of a finished batch")
    r.add_argument("id")
    r.add_argument("-o", "--output", help="write output lines here instead of stdout")
    r.add_argument("--errors", help="write error lines here instead of stderr")
    r.set_defaults(func=cmd_results)
