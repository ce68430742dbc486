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
    for name in ("grove-api", "grove-coordinator"):
        pod = workloads()[name]
        assert all(m["name"] == "data" for c in pod["containers"] for m in c["volumeMounts"])
        assert pod["volumes"] == [{"name": "data", "persistentVolumeClaim": {"claimName": "grove-data"}}]


def deployment(name: str) -> dict[str, Any]:
    return next(d for _, d in DOCS if d["kind"] == "Deployment" and d["metadata"]["name"] == name)


def test_the_api_runs_apart_from_the_coordinator_in_two_replicas_on_a_volume_they_can_share() -> None:
    api, coordinator = deployment("grove-api"), deployment("grove-coordinator")
    assert [c["name"] for c in api["spec"]["template"]["spec"]["containers"]] == ["api"]
    assert {c["name"] for c in coordinator["spec"]["template"]["spec"]["containers"]} == {
        "coordinator",
        "cloner",
    }
    assert api["spec"]["replicas"] >= 2
    assert api["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, "a rollout keeps every replica up"
    assert coordinator["spec"]["replicas"] == 1 and coordinator["spec"]["strategy"] == {"type": "Recreate"}, (
        "one beat: the reconciler is scheduled once"
    )
    # Both schedule the schema migration first (it holds an advisory lock: never twice at once).
    for d in (api, coordinator):
        (init,) = d["spec"]["template"]["spec"]["initContainers"]
        assert init["command"] == ["grove", "migrate"]
    # The Service sends requests to the API's pods only; a disruption budget keeps one of them up.
    (svc,) = [d for _, d in DOCS if d["kind"] == "Service" and d["metadata"]["name"] == "grove-api"]
    assert svc["spec"]["selector"] == api["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["selector"] != coordinator["spec"]["selector"]["matchLabels"]
    (pdb,) = [d for _, d in DOCS if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["selector"] == api["spec"]["selector"] and pdb["spec"]["minAvailable"] >= 1
    # Pods on several nodes mount the data claim: it must be ReadWriteMany.
    (claim,) = [
        d for _, d in DOCS if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == "grove-data"
    ]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # The dashboard and remote workers reach the API through the Service, by its name.
    urls = {
        e.get("value")
        for c in containers().values()
        for e in c.get("env", [])
        if e["name"] == "GROVE_API_URL"
    }
    assert urls and all(u and u.startswith("http://grove-api:8000") for u in urls), urls


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
    assert pods["grove-coordinator"]["terminationGracePeriodSeconds"] >= 60
    assert pods["grove-api"]["terminationGracePeriodSeconds"] >= 30
