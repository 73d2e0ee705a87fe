"""`farm config import-vsr` and `farm semantic test`: the semantic layer's configuration and decisions from the
terminal.

    farm config import-vsr FILE [-o OUT.yaml] [--map-model VSR_NAME=FARM_NAME ...] [--strict]
    farm semantic test "prompt" [--model MoM] [--system TEXT] [--json]

`import-vsr` translates a vLLM Semantic Router config.yaml into a farm override (farm/config/vsr/: flat, decisions, v0.3), names on
stderr each key that has no equivalent, and checks the result against this farm's configuration (its models
above all) before writing it. `semantic test` runs the layer once, as the API would for that request but
without the cache, and says why it decided what it did: the guards' verdicts, the category with its rule and
runners-up, the model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from farm.config import ConfigError, FarmConfig, load_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    cfg = sub.add_parser("config", help="configuration tools: import a vLLM Semantic Router config.yaml")
    csub = cfg.add_subparsers(dest="config_command", metavar="{import-vsr}")
    imp = csub.add_parser("import-vsr", help="translate a vLLM Semantic Router config.yaml into a farm override, "
                          "naming each key that has no equivalent")
    imp.add_argument("file", help="the Semantic Router's config.yaml (flat, with decisions, or version v0.3)")
    imp.add_argument("-o", "--output", metavar="OUT", help="write the override here (default: stdout)")
    imp.add_argument("--map-model", action="append", default=[], metavar="VSR=FARM",
                     help="a Semantic Router model name and the farm model that takes its place (repeatable)")
    imp.add_argument("--strict", action="store_true", help="fail (status 1) when any key has no equivalent")
    imp.set_defaults(func=cmd_import_vsr)

    sem = sub.add_parser("semantic", help="the semantic layer: see what it decides for a prompt")
    ssub = sem.add_subparsers(dest="semantic_command", metavar="{test}")
    t = ssub.add_parser("test", help="run the semantic layer on a prompt and show the decision and why")
    t.add_argument("prompt", help="the user's message")
    t.add_argument("--model", default="MoM", help="the model the request names (default: MoM, the layer chooses)")
    t.add_argument("--system", metavar="TEXT", help="a system message before the prompt")
    t.add_argument("--history", metavar="FILE", help="earlier turns of the conversation, before the prompt: a JSON "
                   "array of OpenAI chat messages ('-': stdin); the layer then decides as for that conversation")
    t.add_argument("--json", action="store_true", help="one JSON object instead of text")
    t.set_defaults(func=cmd_semantic_test)


# -- farm config import-vsr ---------------------------------------------------------------------------------
def cmd_import_vsr(cfg: FarmConfig, args: argparse.Namespace) -> int:
    from farm.config.loader import _deep_merge, _read_yaml
    from farm.config.vsr import translate_vsr

    model_map = {}
    for pair in args.map_model:
        old, sep, new = pair.partition("=")
        if not sep or not old or not new:
            raise ConfigError(f"--map-model {pair!r}: expected VSR_NAME=FARM_NAME")
        model_map[old] = new
    result = translate_vsr(_read_yaml(Path(args.file)), model_map)
    for line in result.unmapped:
        print(f"farm: import-vsr: {line}", file=sys.stderr)
    for line in result.notes:
        print(f"farm: import-vsr: note: {line}", file=sys.stderr)
    # checked as it will be used: on top of this farm's own override file (its models), through the loader
    farm_override = os.environ.get("FARM_CONFIG")
    base = _read_yaml(Path(farm_override)) if farm_override else {}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(_deep_merge(base, result.config), f, sort_keys=False)
    try:
        load_config(f.name, environ={k: v for k, v in os.environ.items() if k != "FARM_CONFIG"})
    except ConfigError as e:
        raise ConfigError(f"{args.file}: the translated configuration is not valid for this farm "
                          f"(--map-model renames models): {str(e).replace(f.name, args.file)}") from None
    finally:
        os.unlink(f.name)
    header = (f"# translated from {args.file} by `farm config import-vsr`; "
              f"{len(result.unmapped)} key(s) had no equivalent:\n"
              + "".join(f"#   {line}\n" for line in result.unmapped))
    text = header + yaml.safe_dump(result.config, sort_keys=False, allow_unicode=True)
    if args.output:
        Path(args.output).write_text(text)
        print(f"farm: wrote {args.output} (use it as FARM_CONFIG, or merge it into yours)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 1 if args.strict and result.unmapped else 0


# -- farm semantic test -------------------------------------------------------------------------------------
def cmd_semantic_test(cfg: FarmConfig, args: argparse.Namespace) -> int:
    from farm.semantic.layer import SemanticLayer

    scfg = cfg.semantic
    no_cache = scfg.model_copy(update={"cache": scfg.cache.model_copy(update={"enabled": False})})
    layer = SemanticLayer.from_config(cfg.model_copy(update={"semantic": no_cache}))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + _history(args.history) + [
        {"role": "user", "content": args.prompt}]
    v = layer.before(args.model, messages)
    report = explain(v, args.model, layer.is_alias(args.model))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0


def _history(path: str | None) -> list[dict[str, Any]]:
    """The earlier turns `--history` names, checked as the API checks a request's messages (ConfigError, naming
    the file, when they are not a list of chat messages)."""
    if path is None:
        return []
    from pydantic import ValidationError

    from farm.openai.schemas import ChatMessage

    try:
        raw = json.loads(sys.stdin.read() if path == "-" else Path(path).read_text())
        if not isinstance(raw, list):
            raise ValueError("expected a JSON array of chat messages")
        return [ChatMessage.model_validate(m).model_dump(exclude_none=True) for m in raw]
    except (OSError, ValueError, ValidationError) as e:
        raise ConfigError(f"--history {path}: {e}") from None


def explain(v: Any, requested: str, routed: bool) -> dict[str, Any]:
    """The verdict as a plain record: decision, guards, category (rule, runners-up), model, headers."""
    from farm.semantic.layer import H_FAST  # loaded already: the layer made the verdict

    ex = v.explain
    cat = ex.get("category")
    fast = v.headers.get(H_FAST) == "true"
    return {
        "decision": v.action, "finish_reason": v.finish_reason, "requested_model": requested, "model": v.model,
        "model_rule": ("the category's fast_response answers, no model" if fast else
                       "as requested" if not routed else "not chosen (blocked first)" if cat is None else
                       "the category's best-scored served model" if cat["accepted"] else
                       "the default model (no category accepted)"),
        "category": cat and {**cat, "alternatives": [{"name": n, "confidence": c, "rule": r}
                                                     for n, c, r in cat["alternatives"]]},
        "reasoning": v.reasoning, "jailbreak": ex.get("jailbreak"), "pii": ex.get("pii"),
        "fallback": ex.get("fallback"), "conversation": ex.get("conversation"),
        "system_prompt_injected": v.headers.get("x-vsr-injected-system-prompt") == "true",
        "headers": v.headers, "timings_ms": {k: round(x, 2) for k, x in v.timings_ms.items()},
    }


def render(r: dict[str, Any]) -> str:
    lines = [f"decision:   {r['decision']}" + (f" ({r['finish_reason']})" if r["finish_reason"] else "")]
    jb = r["jailbreak"]
    if jb:
        verdict = "BLOCK" if jb["blocked"] else "pass"
        lines.append(f"jailbreak:  {verdict}: attack probability {jb['confidence']:.3f} "
                     f"({'>=' if jb['blocked'] else '<'} {jb['threshold']:.3f}) in message {jb['message']} "
                     f"({jb['role']})" + (f", type {jb['type']}" if jb["blocked"] else "")
                     + (" by the remote guard" if jb.get("guard") == "remote" else ""))
        remote = jb.get("remote")
        if remote:
            lines.append(f"            remote guard: {remote['asked']} asked, {remote['remembered']} remembered"
                         + (f" ({remote['ms']:.1f} ms)" if "ms" in remote else "")
                         + (f"; failed: {remote['error']}" if "error" in remote else ""))
    pii = r["pii"]
    if pii:
        found = ", ".join(pii["found"]) or "none"
        denied = ", ".join(pii["denied"])
        lines.append(f"pii:        {'BLOCK' if denied else 'pass'}: found {found}"
                     + (f"; denied by {pii['policy']}'s policy: {denied}" if denied else ""))
    cat = r["category"]
    if cat:
        rule = {"custom": "custom similarity (description + examples)", "keyword": "keywords (the category's)"}.get(
            cat["rule"], "trained head")
        accepted = "" if cat["accepted"] else " (below semantic.classifier.threshold: not accepted)"
        lines.append(f"category:   {cat['name']}, confidence {cat['confidence']:.3f}, rule: {rule}{accepted}")
        alts = ", ".join(f"{a['name']} {a['confidence']:.3f} ({a['rule']})" for a in cat["alternatives"])
        lines.append(f"  runners-up: {alts}")
    conv = r["conversation"]
    if conv:
        own = conv["last_turn"]
        lines.append(f"conversation: {conv['user_turns']} user turns; the category is user turn "
                     f"{conv['decided_at_turn']}'s" + (" (a later turn switched it)" if conv["switched"] else "")
                     + f"; the last turn alone: {own['name']} {own['confidence']:.3f}")
    reasoning = {None: "-", True: "on", False: "off"}[r["reasoning"]]
    lines.append(f"model:      {r['model']} ({r['model_rule']}); reasoning {reasoning}; "
                 f"system prompt injected: {'yes' if r['system_prompt_injected'] else 'no'}")
    if r["fallback"]:
        lines.append(f"fallback:   passed over {', '.join(r['fallback']['passed_over'])} (no live worker)")
    lines.append(f"time:       {r['timings_ms'].get('total', 0):.1f} ms "
                 + " ".join(f"{k} {x:.1f}" for k, x in r["timings_ms"].items() if k != "total"))
    return "\n".join(lines)
