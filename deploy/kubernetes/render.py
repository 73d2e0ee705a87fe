#!/usr/bin/env python3
"""`helm template` and `helm lint` for the inference-farm chart where no helm binary is installed.

The chart is rendered by Helm itself: the `helm-python-sdk` package (import name `helm_python`) binds
Helm's Go SDK (v4) through a C library shipped in its wheel, so templates, `values.schema.json`,
`required`/`fail` and the Sprig functions behave exactly as with the helm CLI. No cluster is contacted
(`lookup` returns nothing, so generated secrets are new random values).

    python deploy/kubernetes/render.py                                   # default values, to stdout
    python deploy/kubernetes/render.py -f examples/values-gpu.yaml --set frontend.routerMode=random
    python deploy/kubernetes/render.py --lint -f my-values.yaml          # helm lint --strict

Needs `pip install helm-python-sdk` (part of the project's `test` extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parent / "helm" / "inference-farm"


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of -f files: maps merge key by key, everything else (lists too) is replaced."""
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_values(files: list[str | Path] = (), sets: list[str] = ()) -> dict[str, Any]:
    """User values from -f files (later ones win) and --set assignments (Helm's own parser)."""
    values: dict[str, Any] = {}
    for f in files:
        data = yaml.safe_load(Path(f).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{f}: values must be a mapping")
        values = deep_merge(values, data)
    if sets:
        import helm_python as helm

        # All --set assignments parsed together, as helm does (list indexes accumulate); their result
        # is merged over the files (helm would also edit lists from the files in place: prefer -f there).
        values = deep_merge(values, helm.parse_set_string(",".join(sets)))
    return values


def render(values: dict[str, Any] | None = None, *, name: str = "farm", namespace: str = "default",
           chart: Path = CHART) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` computes it (values.schema.json enforced)."""
    import helm_python as helm

    with helm.Chart.load(str(chart)) as c:
        return c.render(values or {}, name=name, namespace=namespace, is_install=True)


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """The Kubernetes objects of a rendering (NOTES.txt and empty documents left out)."""
    docs: list[dict[str, Any]] = []
    for path in sorted(rendered):
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(rendered[path]):
            if doc:
                docs.append(doc)
    return docs


def lint(values: dict[str, Any] | None = None, *, chart: Path = CHART, namespace: str = "default",
         kube_version: str | None = None) -> list[str]:
    """`helm lint --strict`: the findings of severity warning or error, as text (empty = clean)."""
    import helm_python as helm

    report = helm.lint(str(chart), values or {}, strict=True, namespace=namespace, kube_version=kube_version)
    names = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}
    return [f"[{names.get(m['severity'], m['severity'])}] {m['path']}: {m['error'].strip()}"
            for m in report.get("messages", []) if m["severity"] >= 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-f", "--values", action="append", default=[], metavar="FILE", help="values file (repeatable)")
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="as helm --set (repeatable)")
    p.add_argument("--name", default="farm", help="release name (default: farm)")
    p.add_argument("-n", "--namespace", default="default")
    p.add_argument("--lint", action="store_true", help="lint (strict) instead of rendering")
    args = p.parse_args(argv)
    values = load_values(args.values, args.set)
    if args.lint:
        findings = lint(values, namespace=args.namespace)
        for line in findings:
            print(line)
        print(f"{CHART.name}: {'1 chart linted, 0 failed' if not findings else 'lint failed'}")
        return 1 if findings else 0
    rendered = render(values, name=args.name, namespace=args.namespace)
    for path in sorted(rendered):
        text = rendered[path].strip()
        if path.endswith("NOTES.txt") or not text:
            continue
        print(f"---\n# Source: {path}\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
