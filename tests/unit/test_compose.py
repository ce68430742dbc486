"""docker-compose.yml: valid against the Compose spec, and every command it names exists here."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import yaml
from compose_spec import PyCompose
from typer.testing import CliRunner

from backend.cli.main import app
from backend.core.config import PROJECT_ROOT

COMPOSE = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())  # anchors and merges resolved
SERVICES = COMPOSE["services"]


def test_compose_file_follows_the_compose_spec() -> None:
    parsed = PyCompose.from_json(json.dumps(COMPOSE))
    assert set(parsed.service_names()) == {
        "redis", "postgres", "migrate", "api", "coordinator", "worker-cpu", "worker-gpu", "dashboard",
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


def test_gpu_worker_reserves_a_gpu_and_grove_services_share_volumes() -> None:
    devices = SERVICES["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    for name in ("api", "coordinator", "worker-cpu", "worker-gpu"):
        mounts = SERVICES[name]["volumes"]
        assert "grove-data:/data" in mounts and "grove-worktrees:/worktrees" in mounts, name
        assert SERVICES[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


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


def test_env_example_defines_what_the_services_read() -> None:
    keys = {
        line.split("=", 1)[0]
        for line in (PROJECT_ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert {"GROVE_DATABASE_URL", "GROVE_REDIS_URL", "POSTGRES_PASSWORD"} <= keys


def test_dockerfile_copies_existing_paths() -> None:
    for line in (PROJECT_ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (Path(PROJECT_ROOT) / src).exists(), src
