"""The dependency audit: requirements.lock pins what pyproject asks for, and .ci/audit_deps.py fails on a
vulnerability but not on an unreachable vulnerability service (unless strict)."""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib

from tests.procs import ROOT

spec = importlib.util.spec_from_file_location("audit_deps", ROOT / ".ci" / "audit_deps.py")
audit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(audit)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_lock_pins_every_direct_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    lock = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        name, _, version = line.partition("==")
        assert version and " @ " not in line, f"not an exact pin: {line!r}"
        lock[_norm(name)] = version
    for req in wanted:
        name = _norm(re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0])
        assert name in lock, f"{name} is not in requirements.lock: run `make lock`"


def report(*deps) -> str:
    return json.dumps({"dependencies": list(deps), "fixes": []})


def test_a_vulnerability_fails():
    status, text = audit.decide(1, report({"name": "flask", "version": "0.1", "vulns": [
        {"id": "PYSEC-0000-1", "fix_versions": ["3.1.3"]}]}, {"name": "x", "version": "1", "vulns": []}), "")
    assert status == 1 and "PYSEC-0000-1" in text and "flask" in text


def test_unreachable_service_warns_but_does_not_fail():
    skipped = report(*[{"name": n, "skip_reason": "Dependency not found on PyPI"} for n in ("a", "b")])
    assert audit.decide(0, skipped, "")[0] == 0
    assert "NOT audited" in audit.decide(0, skipped, "")[1]
    assert audit.decide(0, skipped, "", strict=True)[0] == 1
    err = "requests.exceptions.ConnectionError: Max retries exceeded with url: /v1/query (NameResolutionError)"
    assert audit.decide(1, "", err) == (0, audit.decide(1, "", err)[1])
    assert audit.decide(1, "", err, strict=True)[0] == 1


def test_clean_audit_passes_and_a_broken_tool_fails():
    ok = report({"name": "a", "version": "1", "vulns": []}, {"name": "torch", "skip_reason": "local version"})
    status, text = audit.decide(0, ok, "")
    assert status == 0 and "1 audited" in text and "torch" in text
    assert audit.decide(2, "", "usage: pip-audit: error: unrecognized arguments")[0] == 1


def test_ignore_file_format(tmp_path):
    f = tmp_path / "ignore.txt"
    f.write_text("# advisories we accept\nGHSA-xxxx-yyyy  # not reachable: we never call it\n\n")
    assert audit.ignored_ids(f) == ["GHSA-xxxx-yyyy"]
