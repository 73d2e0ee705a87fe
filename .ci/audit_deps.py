#!/usr/bin/env python3
"""Known-vulnerability audit of the locked dependencies (requirements.lock, `make lock`) with pip-audit.

Exit status, and why:
- 1 when pip-audit reports a vulnerability in a locked version (CI goes red: upgrade, re-lock, or list
  the advisory id with a reason in .ci/audit-ignore.txt);
- 0 when the vulnerability service cannot be reached (offline CI, a mirror without PyPI's JSON API):
  a warning is printed, but CI is not red for the network alone. FARM_AUDIT_STRICT=1 makes that a
  failure too, for CI that has the network;
- 0 with a note for single packages the service does not know (local builds such as torch+cpu,
  wheels that are not on PyPI);
- 1 when pip-audit itself fails for any other reason (a broken audit is noticed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
IGNORE_FILE = ROOT / ".ci" / "audit-ignore.txt"
TIMEOUT_S = 600
NETWORK_ERRORS = re.compile(r"ConnectionError|NameResolutionError|Max retries exceeded|timed out|Timeout|"
                            r"Temporary failure in name resolution|Network is unreachable|SSLError")


def ignored_ids(path: Path = IGNORE_FILE) -> list[str]:
    """Advisory ids to ignore: one per line, `ID  # why`; blank lines and comments skipped."""
    if not path.exists():
        return []
    ids = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            ids.append(line)
    return ids


def decide(returncode: int, stdout: str, stderr: str, strict: bool = False) -> tuple[int, str]:
    """(exit status, report) from one pip-audit run with `--format json`."""
    try:
        report: dict[str, Any] = json.loads(stdout) if stdout.strip() else {}
    except ValueError:
        report = {}
    deps = report.get("dependencies")
    if deps is None:  # no report: pip-audit failed before auditing
        if NETWORK_ERRORS.search(stderr):
            msg = "WARNING: the vulnerability service is unreachable; dependencies NOT audited"
            return (1 if strict else 0), msg
        return 1, f"pip-audit failed (status {returncode}):\n{stderr[-2000:]}"
    vulnerable = [d for d in deps if d.get("vulns")]
    skipped = [d for d in deps if d.get("skip_reason")]
    audited = len(deps) - len(skipped)
    lines = []
    for d in vulnerable:
        for v in d["vulns"]:
            fixes = ", ".join(v.get("fix_versions") or []) or "none yet"
            lines.append(f"VULNERABLE {d['name']} {d['version']}: {v['id']} (fixed in: {fixes})")
    if vulnerable:
        return 1, "\n".join(lines)
    if deps and audited == 0:
        msg = (f"WARNING: none of {len(deps)} locked packages could be audited (the service is unreachable "
               "from here, or this index has no PyPI JSON API); dependencies NOT audited")
        return (1 if strict else 0), msg
    note = f"no known vulnerabilities in {audited} audited packages"
    if skipped:
        note += f"; not audited ({len(skipped)}): " + ", ".join(d["name"] for d in skipped)
    return 0, note


def main(argv: list[str]) -> int:
    lock = Path(argv[1]) if len(argv) > 1 else ROOT / "requirements.lock"
    if not lock.exists():
        print(f"{lock} is missing: run `make lock`", file=sys.stderr)
        return 1
    exe = Path(sys.executable).with_name("pip-audit")
    cmd = [str(exe) if exe.exists() else "pip-audit", "-r", str(lock), "--no-deps", "--disable-pip",
           "--progress-spinner", "off", "--format", "json", "--timeout", "15"]
    for vid in ignored_ids():
        cmd += ["--ignore-vuln", vid]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        status, report = decide(proc.returncode, proc.stdout, proc.stderr,
                                strict=os.environ.get("FARM_AUDIT_STRICT") == "1")
    except subprocess.TimeoutExpired:
        status, report = (1 if os.environ.get("FARM_AUDIT_STRICT") == "1" else 0), (
            f"WARNING: pip-audit did not finish in {TIMEOUT_S}s; dependencies NOT audited")
    print(f"pip-audit ({lock.name}): {report}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
