"""docker-compose.yml: valid against the Compose spec, and every command it names exists here."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import yaml
from compose_spec import PyCompose
from typer.testing import CliRunner

from backend.cli.main import app
from backend.core.config import PROJECT_ROOT, Settings

COMPOSE = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())  # anchors and merges resolved
SERVICES = COMPOSE["services"]


def test_compose_file_follows_the_compose_spec() -> None:
    parsed = PyCompose.from_json(json.dumps(COMPOSE))
    assert set(parsed.service_names()) == {
        "redis", "postgres", "migrate", "api", "coordinator", "cloner", "worker-sealed", "worker-cpu-1",
        "worker-cpu-2", "worker-gpu", "dashboard",
    }  # fmt: skip


def test_dashboard_reaches_only_the_api() -> None:
    board = SERVICES["dashboard"]
    assert board["environment"] == {"GROVE_API_URL": "http://api:8000/api/v1"}
    assert "env_file" not in board and "volumes" not in board
    assert board["depends_on"]["api"]["condition"] == "service_healthy"


def test_every_long_running_service_has_a_healthcheck() -> None:
    for name, svc in SERVICES.items():
        if name != "migrate":
            assert svc.get("healthcheck", {}).get("test"), name


def test_gpu_worker_reserves_a_gpu_and_is_optional() -> None:
    gpu = SERVICES["worker-gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert gpu["profiles"] == ["gpu"] and gpu["command"][3] == "gpu,gpu-sealed"
    # It runs learning jobs too, which need the database: it sits beside it like the coordinator.
    assert "grove-data:/data" in gpu["volumes"] and gpu["env_file"] == ".env"


def test_sealed_jobs_run_only_beside_the_database() -> None:
    sealed = [n for n, svc in SERVICES.items() if "sealed" in ",".join(svc.get("command", [])[3:4])]
    assert sealed == ["worker-sealed", "worker-gpu"]
    for name in sealed:
        svc = SERVICES[name]
        assert "grove-data:/data" in svc["volumes"] and svc["env_file"] == ".env", name
        assert "GROVE_WORKER_TOKEN" not in svc.get("environment", {}), name
    # The fleet's workers hold the fleet token, which the API never trusts with a sealed job.
    for name in ("worker-cpu-1", "worker-cpu-2"):
        assert SERVICES[name]["command"][3] == "cpu", name


def test_api_and_coordinator_share_data_and_workers_share_nothing() -> None:
    for name in ("api", "coordinator", "cloner", "worker-sealed"):
        mounts = SERVICES[name]["volumes"]
        assert "grove-data:/data" in mounts and "grove-worktrees:/worktrees" in mounts, name
        assert SERVICES[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    workers = [n for n in SERVICES if n.startswith("worker-cpu")]
    volumes = [SERVICES[n]["volumes"] for n in workers]
    assert len(workers) == 2 and all(len(v) == 1 and v[0].endswith(":/data") for v in volumes)
    assert len({v[0] for v in volumes}) == 2, "each cpu worker has a volume of its own"
    for name in workers:
        svc = SERVICES[name]
        env = svc["environment"]
        # No database, no shared volume: only the API, the fleet token, Redis and the model's key.
        assert "env_file" not in svc and not any("DATABASE" in k for k in env), name
        assert env["GROVE_API_URL"] == "http://api:8000" and "GROVE_WORKER_TOKEN" in env
        assert svc["depends_on"] == {"api": {"condition": "service_healthy"}}


def _grove_command_exists(argv: list[str]) -> None:
    result = CliRunner().invoke(app, [argv[1], "--help"])
    assert result.exit_code == 0, f"grove {argv[1]}: {result.output}"
    for arg in argv[2:]:
        if arg.startswith("--"):
            assert arg in result.output, f"grove {argv[1]} has no option {arg}"


def _command(svc: dict[str, Any]) -> list[str]:
    return [str(x) for x in svc["command"]]


def test_every_command_names_something_in_the_project() -> None:
    for name, svc in SERVICES.items():
        if svc.get("image", "").startswith(("redis", "postgres")):
            continue
        argv = _command(svc)
        if argv[0] == "grove":
            _grove_command_exists(argv)
        elif argv[0] == "streamlit":
            assert argv[1] == "run" and (PROJECT_ROOT / argv[2]).is_file(), name
        elif argv[0] == "uvicorn":
            module, attr = argv[1].split(":")
            assert hasattr(importlib.import_module(module), attr), name
        else:
            raise AssertionError(f"{name}: unexpected program {argv[0]}")
        for part in svc.get("healthcheck", {}).get("test", [])[1:2]:
            if part == "celery":
                importlib.import_module("backend.worker.celery_app")


def test_env_example_documents_every_setting() -> None:
    text = (PROJECT_ROOT / ".env.example").read_text()
    keys = {line.lstrip("# ").split("=", 1)[0] for line in text.splitlines() if "=" in line}
    assert {"GROVE_DATABASE_URL", "GROVE_REDIS_URL", "POSTGRES_PASSWORD", "GROVE_FLEET_TOKEN"} <= keys
    settings = {f"GROVE_{name.upper()}" for name in Settings.model_fields}
    assert settings <= keys, sorted(settings - keys)
    # And every GROVE_ variable the code reads by name.
    read = set()
    for path in [*PROJECT_ROOT.glob("backend/**/*.py"), *PROJECT_ROOT.glob("agents/**/*.py"),
                 *PROJECT_ROOT.glob("frontend/**/*.py")]:  # fmt: skip
        read |= set(re.findall(r"environ(?:\.get)?\(\s*\"(GROVE_[A-Z_]+)\"", path.read_text()))
        read |= set(re.findall(r"environ\[\"(GROVE_[A-Z_]+)\"\]", path.read_text()))
    assert read and read - {"GROVE_SEED", "GROVE_METRICS_FILE"} <= keys, sorted(read - keys)


def test_dockerfile_copies_existing_paths() -> None:
    for line in (PROJECT_ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (Path(PROJECT_ROOT) / src).exists(), src


def test_redis_asks_for_a_password_and_every_service_gives_it() -> None:
    redis_cmd = SERVICES["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?")
    urls = {name: svc.get("environment", {}).get("GROVE_REDIS_URL") for name, svc in SERVICES.items()}
    users = [name for name in SERVICES if name not in ("redis", "postgres", "migrate", "dashboard")]
    assert users and all(str(urls[name]).startswith("redis://:${REDIS_PASSWORD") for name in users), urls


def test_workers_get_time_to_finish_what_runs_when_stopped() -> None:
    for name in ("worker-sealed", "worker-cpu-1", "worker-cpu-2", "worker-gpu"):
        assert SERVICES[name]["stop_grace_period"] == "1h", name
