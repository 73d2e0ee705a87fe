"""What a code change costs the chat path: one API process's output tok/s per API core (bench/engine_speed's
`--api-scale`, the farm alone) for two revisions of the farm, in alternating order over several rounds.

    .venv/bin/python -m bench.api_cost --base HEAD~1              # the base revision against the working tree
    .venv/bin/python -m bench.api_cost --base b32c05e --head HEAD  # two revisions

Why: the farm's API process is what a near-free engine leaves to measure (bench/engine_speed), so a feature on
the request path (tool calling, tracing, new routes beside the chat route) shows up there first. Each revision
runs from a checkout of its own (`git worktree`, the working tree itself for `--head .`), in a process of its
own whose farm processes import that checkout; the tiny model and the load are bench/engine_speed's. A level
with an error is FAILED. Writes bench/out/api_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR, alternating, finish, goal, machine_info, table

ROOT = Path(__file__).resolve().parents[1]
NO_COST = 0.95
# run inside one revision's checkout (PYTHONPATH): its own bench code drives its own farm
DRIVER = """
import json, sys
from pathlib import Path
from bench.engine_speed import scale
from bench.engine_speed.model import make_tiny_model
from bench.peers import contenders as pc, install
levels, seconds, max_tokens, model_dir, out = json.loads(sys.argv[1])
mdir = make_tiny_model(Path(model_dir))
s = pc.Setup(mdir, install.PEERS_DIR / "logs" / "api_cost", kv_bytes=1024 * 2**20, block_size=32,
             max_model_len=2048, enforce_eager=False)
res = scale.run_scale(s, levels, seconds, max_tokens, 900.0, contenders=("farm",))
Path(out).write_text(json.dumps(res["farm"], default=str))
"""


def checkout(rev: str, tmp: Path) -> Path:
    """A directory holding revision `rev` ("." = the working tree as it is)."""
    if rev == ".":
        return ROOT
    path = tmp / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), rev], check=True,
                   capture_output=True)
    models = ROOT / ".farm" / "models"  # the prepared models (their tokenizer makes the tiny model): shared
    if models.is_dir():
        (path / ".farm").mkdir(mode=0o700, exist_ok=True)
        (path / ".farm" / "models").symlink_to(models)
    return path


def run_one(tree: Path, levels: list[int], seconds: float, max_tokens: int, tmp: Path) -> dict[str, Any]:
    out = tmp / f"run-{os.getpid()}-{len(list(tmp.iterdir()))}.json"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    arg = json.dumps([levels, seconds, max_tokens, str(tmp / "model"), str(out)])
    proc = subprocess.run([sys.executable, "-c", DRIVER, arg], cwd=tree, env=env)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"driver exited {proc.returncode}"}
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.api_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the revision to compare against (a git revision)")
    ap.add_argument("--head", default=".", help="the revision measured ('.': the working tree, default)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--levels", default="64,256", help="concurrent streams per level")
    ap.add_argument("--seconds", type=float, default=20.0, help="requests are sent for this long per level")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(OUT_DIR / "api_cost.json"))
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",") if x]
    command = f"{sys.executable} -m bench.api_cost {' '.join(sys.argv[1:] if argv is None else argv)}"
    info = machine_info()
    print(f"command: {command}\ndate: {info['date_utc']}; load average {info['load_average']}", flush=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="api-cost-") as t:
        tmp = Path(t)
        trees = {"base": checkout(args.base, tmp), "head": checkout(args.head, tmp)}
        try:
            for rnd, name in alternating(["base", "head"], args.rounds):
                print(f"[round {rnd + 1}] {name} ({args.base if name == 'base' else args.head})", flush=True)
                runs.append({"round": rnd, "revision": name, **run_one(trees[name], levels, args.seconds,
                                                                      args.max_tokens, tmp)})
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                                   capture_output=True)
    rows, summary = [], {}
    for streams in levels:
        per: dict[str, list[float]] = {"base": [], "head": []}
        failed = False
        for r in runs:
            lv = (r.get("levels") or {}).get(str(streams)) or (r.get("levels") or {}).get(streams)
            if not lv or lv.get("failed") or lv.get("tok_s_per_api_core") is None:
                failed = True
                continue
            per[r["revision"]].append(lv["tok_s_per_api_core"])
        med = {k: statistics.median(v) if v else None for k, v in per.items()}
        ratio = med["head"] / med["base"] if med["head"] and med["base"] else None
        summary[streams] = {"base": per["base"], "head": per["head"], "ratio": ratio, "failed": failed}
        rows.append([streams, "FAILED" if failed else "ok", med["base"], med["head"], ratio,
                     " / ".join(f"{x:,.0f}" for x in per["base"]), " / ".join(f"{x:,.0f}" for x in per["head"])])
    print("\nOutput tok/s per API core (medians over rounds; by round beside)")
    print(table(["streams", "status", "base", "head", "head/base", "base by round", "head by round"], rows))
    # "no measurable cost": within the spread of repeated runs of one revision (a few percent on this machine)
    goals = [goal(f"head/base tok/s per API core at {streams} streams", v["ratio"], NO_COST)
             for streams, v in summary.items() if v["ratio"] is not None]
    finish(args.out, {"benchmark": "api_cost", "command": command, "base": args.base, "head": args.head,
                      "levels": levels, "seconds": args.seconds, "max_tokens": args.max_tokens, "runs": runs,
                      "summary": summary}, goals)
    return 1 if any(v["failed"] for v in summary.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
