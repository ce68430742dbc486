"""The worker health checks of docker-compose.yml and deploy/kubernetes, executed as Docker and the kubelet would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from backend.core.config import PROJECT_ROOT
from tests.support.services import sqlite_service

SERVICES = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())["services"]
PODS = {
    d["metadata"]["name"]: d["spec"]["template"]["spec"]
    for f in [
        *PROJECT_ROOT.glob("deploy/kubernetes/*.yaml"),
        *PROJECT_ROOT.glob("deploy/kubernetes/gpu/*.yaml"),
    ]
    for d in yaml.safe_load_all(f.read_text())
    if d and d["kind"] == "Deployment"
}


def probe_argv(pod: str, container: str) -> list[str]:
    """Return what the kubelet runs for a container's exec liveness probe (the argv as written: no shell)."""
    (c,) = [c for c in PODS[pod]["containers"] if c["name"] == container]
    return list(c["livenessProbe"]["exec"]["command"])


def docker_argv(test: list[str]) -> list[str]:
    """Return what Docker runs for a healthcheck `test` after Compose's interpolation ($$ is a literal $)."""
    kind, *rest = test
    rest = [part.replace("$$", "$") for part in rest]
    if kind == "CMD-SHELL":
        return ["/bin/sh", "-c", rest[0]]
    assert kind == "CMD", test
    return rest  # no shell: nothing expands variables


def test_worker_health_checks_pass_against_live_workers(tmp_path: Path, redis_url: str) -> None:
    svc = sqlite_service(tmp_path, redis_url, db_number=14)
    # A container's HOSTNAME is its hostname, which Celery's %h in the worker's node name reads too.
    env = {**svc.env, "HOSTNAME": socket.gethostname()}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the image's `celery`
    checks = {"coordinator": "coordinator", "cloner": "clone", "worker-cpu-1": "cpu", "worker-cpu-2": "cpu",
              "worker-gpu": "gpu", "worker-sealed": "sealed"}  # fmt: skip
    try:
        for name in set(checks.values()):
            svc.start_worker(name, name, 1)
        for service, name in checks.items():
            argv = docker_argv(SERVICES[service]["healthcheck"]["test"])
            done = subprocess.run(argv, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{service}: {argv}\n{done.stdout}\n{done.stderr}"
            assert f"{name}@{socket.gethostname()}: OK" in done.stdout, done.stdout
        probes = {("grove-coordinator", "coordinator"): "coordinator", ("grove-coordinator", "cloner"): "clone",
                  ("grove-worker-cpu", "worker"): "cpu", ("grove-worker-gpu", "worker"): "gpu"}  # fmt: skip
        for (pod, container), name in probes.items():
            argv = probe_argv(pod, container)
            done = subprocess.run(argv, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{pod}/{container}: {argv}\n{done.stdout}\n{done.stderr}"
            assert f"{name}@{socket.gethostname()}: OK" in done.stdout, done.stdout
        # The check must fail for a worker that is not there (it names this container's worker).
        svc.stop_worker("gpu")
        argv = docker_argv(SERVICES["worker-gpu"]["healthcheck"]["test"])
        done = subprocess.run(argv, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        argv = probe_argv("grove-worker-gpu", "worker")
        done = subprocess.run(argv, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
    finally:
        svc.stop()
