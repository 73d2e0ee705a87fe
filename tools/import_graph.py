"""Figures of the farm's import graph, so a restructuring can be measured before and after.

    .venv/bin/python tools/import_graph.py [PACKAGE ...] [--loose-under farm] [--json]

Builds the graph of the packages (`farm api tasks` by default, the roots of the import-linter contracts) with
grimp (installed with import-linter), TYPE_CHECKING imports included (`exclude_type_checking_imports=False`: a
hint that names an upper module still ties the two together), and prints:

- modules (and how many are plain modules, not packages) and packages;
- import cycles: the strongly connected groups of two or more modules (Tarjan's algorithm, below; no networkx);
- modules over 400 and over 500 lines;
- loose modules: plain modules directly under `farm/` (`--loose-under`), beside its subpackages;
- colliding file names: a file name (other than `__init__.py`, `__main__.py`, `cli.py`) held by two or more
  packages.

Reads only; imports nothing of the farm.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
# Names every package may hold without colliding: the package marker, `python -m` entry points, and the
# `cli.py` of a package that adds its own subcommands to `farm`.
SHARED_NAMES = {"__init__.py", "__main__.py", "cli.py"}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative (deep graphs do not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    groups.append(sorted(group))
    return groups


def module_path(module: str) -> Path:
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def measure(packages: list[str], loose_under: str) -> dict:
    graph = grimp.build_graph(*packages, exclude_type_checking_imports=False, cache_dir=None)
    modules = sorted(graph.modules)
    packages = [m for m in modules if module_path(m).name == "__init__.py"]
    edges = {m: set(graph.find_modules_directly_imported_by(m)) & set(modules) for m in modules}
    cycles = sorted((g for g in strongly_connected(edges) if len(g) > 1), key=lambda g: (-len(g), g))
    lines = {m: len(module_path(m).read_text().splitlines()) for m in modules}
    loose = [m for m in modules if m.rpartition(".")[0] == loose_under and m not in packages]
    by_name: dict[str, list[str]] = defaultdict(list)
    for m in modules:
        path = module_path(m)
        if path.name not in SHARED_NAMES:
            by_name[path.name].append(m)
    return {
        "modules": len(modules),
        "plain_modules": len(modules) - len(packages),
        "packages": len(packages),
        "cycles": cycles,
        "over_400": {m: n for m, n in sorted(lines.items()) if n > 400},
        "over_500": {m: n for m, n in sorted(lines.items()) if n > 500},
        "loose": {m: lines[m] for m in loose},
        "colliding_names": {name: ms for name, ms in sorted(by_name.items()) if len(ms) > 1},
    }


def report(figures: dict, packages: list[str], loose_under: str) -> str:
    out = [
        f"{' '.join(packages)}: {figures['modules']} modules ({figures['plain_modules']} plain modules, "
        f"{figures['packages']} packages)",
        f"import cycles (strongly connected groups, TYPE_CHECKING imports counted): {len(figures['cycles'])}",
    ]
    out += [f"  {' <-> '.join(group)}" for group in figures["cycles"]]
    for limit in (400, 500):
        rows = figures[f"over_{limit}"]
        out.append(f"modules over {limit} lines: {len(rows)}")
        out += [f"  {m} {n}" for m, n in rows.items()]
    loose = figures["loose"]
    out.append(f"loose modules under {loose_under}/: {len(loose)} ({sum(loose.values()):,} lines)")
    out += [f"  {m} {n}" for m, n in loose.items()]
    out.append(f"colliding file names: {len(figures['colliding_names'])}")
    out += [f"  {name} x{len(ms)}: {', '.join(ms)}" for name, ms in figures["colliding_names"].items()]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", default=["farm", "api", "tasks"])
    parser.add_argument("--loose-under", default="farm", help="the package whose loose modules are counted")
    parser.add_argument("--json", action="store_true", help="the figures as JSON")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    figures = measure(args.packages, args.loose_under)
    print(json.dumps(figures, indent=2) if args.json else report(figures, args.packages, args.loose_under))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
