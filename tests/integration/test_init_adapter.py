"""`grove init` on repositories with no evaluator: an MLproject, a Hydra app and a script reading a
YAML config. Each becomes a study with no file written by hand: init drafts the spec and the
evaluator adapter (with a dev/held-out split of the data), validate runs it, and a six-experiment
run merges an improvement."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

from backend.core.config import Settings
from tests.integration.test_study import grove
from tests.support.repos import make_repo

ROWS = "".join(f"{7 + i % 5}.{i % 10},{5 + i % 3}\n" for i in range(30))

MLPROJECT = {
    "MLproject": """\
        name: wine
        entry_points:
          main:
            parameters:
              alpha: {type: float, default: 0.5}
              l1_ratio: {type: float, default: 0.5}
            command: "python train.py {alpha} {l1_ratio}"
        """,
    "train.py": """\
        import csv, math, sys

        alpha = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
        l1_ratio = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
        rows = list(csv.DictReader(open("data/wine-quality.csv")))
        spread = sum(abs(float(r["quality"]) - 6) for r in rows) / len(rows)
        rmse = 0.7 + 0.05 * (math.log10(alpha) - math.log10(0.02)) ** 2 + 0.1 * (l1_ratio - 0.2) ** 2 + 0.01 * spread
        print("Elasticnet model (alpha={:f}, l1_ratio={:f}):".format(alpha, l1_ratio))
        print("  RMSE: %s" % rmse)
        print("  MAE: %s" % (0.8 * rmse))
        """,
    "data/wine-quality.csv": "fixed_acidity,quality\n" + ROWS,
}

HYDRA = {
    "app.py": """\
        import csv, math

        import hydra


        @hydra.main(config_path="conf", config_name="config", version_base=None)
        def main(cfg) -> float:
            rows = list(csv.reader(open("data/digits.csv")))
            best, top = {"adam": (0.003, 0.95), "sgd": (0.1, 0.9)}[cfg.optimizer.name]
            acc = top - 0.05 * (math.log10(cfg.optimizer.lr) - math.log10(best)) ** 2 - 0.0001 * len(rows)
            print(f"epoch {cfg.train.epochs}: train_loss={1 - acc:.4f}")
            print(f"val_accuracy={acc:.4f}")
            return acc


        if __name__ == "__main__":
            main()
        """,
    "conf/config.yaml": "defaults:\n  - optimizer: sgd\n  - _self_\ntrain:\n  epochs: 5\n  log_every: 10\n",
    "conf/optimizer/adam.yaml": "name: adam\nlr: 0.1\n",
    "conf/optimizer/sgd.yaml": "name: sgd\nlr: 0.001\n",
    "data/digits.csv": "pixel,label\n" + ROWS,
}

SCRIPT = {
    "main.py": """\
        import argparse, csv, math

        import yaml

        parser = argparse.ArgumentParser()
        parser.add_argument("config", help="the YAML config")
        cfg = yaml.safe_load(open(parser.parse_args().config))
        points = [float(r[0]) for r in csv.reader(open(cfg["data"]["path"]))]
        lr, hidden = cfg["model"]["lr"], cfg["model"]["hidden"]
        for step in range(0, cfg["train"]["steps"] + 1, cfg["train"]["log_n_steps"]):
            far = 0.05 * (math.log10(lr) - math.log10(0.02)) ** 2 + 0.01 * (math.log2(hidden) - 4) ** 2
            loss = 0.1 + far + 1 / (1 + step) + 0.001 * sum(points) / len(points)
            print(f"step {step} loss: {loss:.6f}")
        print(f"n_params: {hidden * 500}")
        """,
    "config.yaml": "data:\n  path: data/points.csv\nmodel:\n  hidden: 2\n  lr: 0.5\ntrain:\n  steps: 50\n  log_n_steps: 10\n",
    "data/points.csv": ROWS,
}


def _study(settings: Settings, repo: Path, goal: str = "improve the model") -> dict[str, object]:
    made = grove(settings, "init", str(repo), "--commit", "--goal", goal)
    assert made.returncode == 0, made.stderr + made.stdout
    spec = tomllib.loads((repo / "grove.toml").read_text())
    assert spec["evaluate"] == {
        "dev": "python grove_eval.py dev",
        "test": "python grove_eval.py test",
        "repeats": 3,
    }
    committed = subprocess.run(
        ["git", "show", "--stat", "--format=", "HEAD"], cwd=repo, capture_output=True, text=True
    )
    assert "grove_eval.py" in committed.stdout and "grove/adapter.json" in committed.stdout
    checked = grove(settings, "validate", str(repo))
    assert checked.returncode == 0, checked.stderr + checked.stdout
    # Grove's own adapter runs only the protected entry point its settings name: no two-phase warning.
    assert "warning" not in checked.stderr, checked.stderr
    base = re.search(rf"dev on base: {spec['objective']['metric']} = ([-0-9.e]+)", checked.stdout)
    assert base, checked.stdout
    ran = grove(settings, "run", str(repo), "--budget", "6", "--auto-approve", timeout=400)
    assert ran.returncode == 0, ran.stderr[-3000:] + ran.stdout[-3000:]
    assert re.search(r"gate\s*│\s*[1-9]\d* passed", ran.stdout), ran.stdout
    trunk = re.search(r"trunk dev\s*│\s*([-0-9.e]+)", ran.stdout)
    assert trunk, ran.stdout
    sign = 1 if spec["objective"]["direction"] == "maximize" else -1
    assert sign * (float(trunk.group(1)) - float(base.group(1))) > 0, (base.group(1), trunk.group(1))
    return {"spec": spec, "init": " ".join(made.stdout.split()), "run": ran.stdout}


def test_mlproject_with_argv_gets_an_adapter_and_a_merged_improvement(
    settings: Settings, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "wine", MLPROJECT)
    out = _study(settings, repo)
    spec = out["spec"]
    assert isinstance(spec, dict)
    assert spec["objective"] == {"metric": "rmse", "direction": "minimize"}
    assert spec["search"]["alpha"]["targets"] == [
        "grove/params.json:alpha",
        "MLproject:entry_points.main.parameters.alpha.default",
    ]
    assert spec["search"]["alpha"]["low"] <= 0.02 <= spec["search"]["alpha"]["high"]
    assert spec["files"]["sealed"] == ["data/wine-quality.csv", "grove/heldout/**"]
    assert "train.py" in out["init"] and "grove_eval.py" in out["init"]


def test_hydra_app_searches_its_optimizer_group_with_each_optimizers_lr(
    settings: Settings, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "digits", HYDRA)
    out = _study(settings, repo)
    spec = out["spec"]
    assert isinstance(spec, dict)
    assert spec["objective"] == {"metric": "val_accuracy", "direction": "maximize"}
    search = spec["search"]
    assert sorted(search["conf/config.yaml:defaults.optimizer"]["values"]) == ["adam", "sgd"]
    # app.py never reads train.epochs: init moved it, saw no metric change, and dropped it.
    assert "dropped from the search" in out["init"] and "conf/config.yaml:train.epochs" in out["init"]
    assert "conf/config.yaml:train.epochs" not in search
    for name in ("adam", "sgd"):
        lr = search[f"conf/optimizer/{name}.yaml:lr"]
        assert lr["when"] == {"conf/config.yaml:defaults.optimizer": name}
        assert lr["log"] is True
    assert not any("log_every" in key for key in search)


def test_script_with_a_yaml_config_argument_gets_it_and_no_logging_knob(
    settings: Settings, tmp_path: Path
) -> None:
    repo = make_repo(tmp_path / "net", SCRIPT)
    out = _study(settings, repo, "Lower the loss and keep the model under 3k parameters")
    spec = out["spec"]
    assert isinstance(spec, dict)
    assert spec["objective"] == {"metric": "loss", "direction": "minimize"}
    adapter = (repo / "grove" / "adapter.json").read_text()
    assert '"main.py"' in adapter and '"config.yaml"' in adapter
    assert not any("log_n_steps" in key for key in spec["search"])
    assert "config.yaml:model.lr" in spec["search"]
    # The goal's limit names a number main.py prints: it becomes a constraint.
    assert spec["constraints"] == [{"name": "n_params", "metric": "n_params", "max": 3000.0}]
    assert "constraint: n_params ≤ 3000, from the goal's 'under 3k parameters'" in out["init"]
