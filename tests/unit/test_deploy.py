"""deploy/kubernetes: valid against Kubernetes' schemas, and the same layout as docker-compose.yml."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from backend.core.config import PROJECT_ROOT, Settings

DEPLOY = PROJECT_ROOT / "deploy" / "kubernetes"
FILES = sorted([*DEPLOY.glob("*.yaml"), *DEPLOY.glob("gpu/*.yaml")])
DOCS = [(f, d) for f in FILES for d in yaml.safe_load_all(f.read_text()) if d]
KUBERNETES = "1.33.0"  # the oldest release these manifests are written for (user-namespaced pods)
COMPOSE = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())["services"]


def workloads() -> dict[str, dict[str, Any]]:
    """Return each Deployment, StatefulSet and Job's pod spec by name."""
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for _, d in DOCS
        if d["kind"] in ("Deployment", "StatefulSet", "Job")
    }


def containers() -> dict[str, dict[str, Any]]:
    return {
        f"{w}/{c['name']}": c
        for w, pod in workloads().items()
        for c in [*pod.get("initContainers", []), *pod["containers"]]
    }


@pytest.mark.parametrize("path", FILES, ids=[str(f.relative_to(DEPLOY)) for f in FILES])
def test_every_manifest_follows_the_kubernetes_schema(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises, naming the field


def test_the_same_processes_run_as_in_docker_compose() -> None:
    ours = {tuple(c["command"]) for c in containers().values() if "command" in c}
    theirs = {
        tuple(s["command"])
        for s in COMPOSE.values()
        if isinstance(s.get("command"), list) and s["command"][0] != "redis-server"
    }
    assert ours == theirs


def test_cpu_workers_share_nothing_with_the_control_pod() -> None:
    cpu = next(d for _, d in DOCS if d["metadata"]["name"] == "grove-worker-cpu")
    assert cpu["spec"]["replicas"] >= 2
    pod = cpu["spec"]["template"]["spec"]
    assert [v.get("emptyDir") is not None for v in pod["volumes"]] == [True], "its own volume, nothing shared"
    (worker,) = pod["containers"]
    names = {e["name"] for e in worker["env"]}
    assert {"GROVE_API_URL", "GROVE_WORKER_TOKEN", "GROVE_REDIS_URL"} <= names
    assert "GROVE_DATABASE_URL" not in names and "envFrom" not in worker
    # The API, the coordinator and the clone worker share one claim, in one pod (so ReadWriteOnce suffices).
    control = workloads()["grove-control"]
    assert {c["name"] for c in control["containers"]} == {"api", "coordinator", "cloner"}
    assert all(m["name"] == "data" for c in control["containers"] for m in c["volumeMounts"])
    assert control["volumes"] == [{"name": "data", "persistentVolumeClaim": {"claimName": "grove-data"}}]


def test_sealed_jobs_run_only_in_pods_beside_the_database() -> None:
    for name, pod in workloads().items():
        for c in pod["containers"]:
            cmd = c.get("command", [])
            if cmd[:2] != ["grove", "worker"] or "sealed" not in cmd[3]:
                continue
            names = {e["name"] for e in c.get("env", [])}
            assert "GROVE_DATABASE_URL" in names and "GROVE_WORKER_TOKEN" not in names, name
            assert pod["volumes"] == [{"name": "data", "persistentVolumeClaim": {"claimName": "grove-data"}}]
    sealed = {
        cmd[3]
        for pod in workloads().values()
        for c in pod["containers"]
        if (cmd := c.get("command", []))[:2] == ["grove", "worker"]
    }
    assert {"sealed", "gpu,gpu-sealed", "cpu"} <= sealed


def test_only_pods_that_run_study_code_relax_the_container_defaults() -> None:
    for name, pod in workloads().items():
        relaxed = pod.get("hostUsers") is False
        commands = [c.get("command", []) for c in pod["containers"]]
        runs_code = any(
            cmd[:2] == ["grove", "worker"] and not {"coordinator", "clone"} & set(cmd) for cmd in commands
        )
        assert relaxed == runs_code, name
        for c in pod["containers"]:
            assert c.get("securityContext", {}).get("procMount", "Default") == (
                "Unmasked" if runs_code else "Default"
            )
            assert "privileged" not in c.get("securityContext", {}), name
        if runs_code:
            # bubblewrap needs a user namespace and a fresh /proc: the same three relaxations as in compose.
            assert pod["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
            assert pod["securityContext"]["appArmorProfile"] == {"type": "Unconfined"}
            assert all(c["securityContext"]["allowPrivilegeEscalation"] is False for c in pod["containers"])
        if pod["containers"][0]["image"].startswith("grove"):
            assert pod["securityContext"]["runAsNonRoot"] is True, name
    for svc in ("worker-cpu-1", "worker-cpu-2", "worker-gpu"):
        assert set(COMPOSE[svc]["security_opt"]) == {
            "seccomp=unconfined",
            "apparmor=unconfined",
            "systempaths=unconfined",
        }
    assert not any("security_opt" in COMPOSE[s] for s in COMPOSE if not s.startswith("worker-")), (
        "least privilege elsewhere"
    )
    assert re.search(r"apt-get install [^&]*\bbubblewrap\b", (PROJECT_ROOT / "Dockerfile").read_text())


def test_every_variable_and_secret_is_known() -> None:
    settings = {f"GROVE_{name.upper()}" for name in Settings.model_fields}
    for path in PROJECT_ROOT.glob("agents/**/*.py"):  # and the few read straight from the environment
        settings |= set(re.findall(r"environ(?:\.get)?\(\s*\"(GROVE_[A-Z_]+)\"", path.read_text()))
    config = next(d for _, d in DOCS if d["kind"] == "ConfigMap")
    names = set(config["data"])
    secrets: set[str] = set()
    for c in containers().values():
        for e in c.get("env", []):
            names.add(e["name"])
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == "grove"
                secrets.add(ref["key"])
    grove = {n for n in names if n.startswith("GROVE_")}
    assert grove <= settings, sorted(grove - settings)
    readme = (DEPLOY / "README.md").read_text()
    for key in secrets:
        assert f"--from-literal={key}=" in readme, f"README.md does not say how to set secret {key}"


def test_every_long_running_container_is_probed() -> None:
    for name, pod in workloads().items():
        for c in pod["containers"]:
            assert c.get("livenessProbe"), f"{name}/{c['name']}"


def test_redis_asks_for_the_secret_password_and_every_pod_reads_its_url_from_the_secret() -> None:
    (redis,) = workloads()["grove-redis"]["containers"]
    assert redis["args"][redis["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in redis["env"]} == {
        "REDIS_PASSWORD": "REDIS_PASSWORD", "REDISCLI_AUTH": "REDIS_PASSWORD"
    }  # fmt: skip
    config = next(d for _, d in DOCS if d["kind"] == "ConfigMap")
    assert "GROVE_REDIS_URL" not in config["data"]
    for name, c in containers().items():
        if name.startswith(("grove-redis", "grove-postgres", "grove-dashboard")) or name.endswith("/migrate"):
            continue
        url = next(e for e in c["env"] if e["name"] == "GROVE_REDIS_URL")
        assert url["valueFrom"]["secretKeyRef"] == {"name": "grove", "key": "GROVE_REDIS_URL"}, name


def test_worker_pods_get_time_to_finish_running_experiments() -> None:
    pods = workloads()
    assert all(pods[w]["terminationGracePeriodSeconds"] >= 600 for w in pods if w.startswith("grove-worker-"))
    assert pods["grove-control"]["terminationGracePeriodSeconds"] >= 60
