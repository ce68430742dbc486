"""Small research studies for the benchmark suite, each a git repository made on the fly.

Every study is stdlib-only and fast: `config.toml` holds the knobs, `objective.py` (protected)
computes the metrics of a configuration on a split for a seed, `eval_dev.py` (protected) prints
the dev metrics and `eval_test.py` (sealed) the held-out ones. Noise is a deterministic hash of
(split, seed) shared by every configuration (pairing by seed removes it) plus a hash of
(split, seed, configuration), salted by the benchmark seed: every method sees exactly the same
numbers for the same run, and each benchmark seed is an independent draw. A study may drop the
noise where it models a deterministic evaluator (`mixed`: dev values identical for every seed).
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = """\
import hashlib, json, math, os, sys, tomllib


def gauss(*key):
    h = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).digest()
    u1 = (int.from_bytes(h[:8], "big") + 1) / (2**64 + 1)
    u2 = int.from_bytes(h[8:16], "big") / 2**64
    return math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)


SALT = 0  # the benchmark seed: each seed of the suite is an independent draw of the noise


def noise(cfg, split, seed, sd):
    return sd * (0.6 * gauss(SALT, split, seed) + 0.8 * gauss(SALT, split, seed, cfg))


def load(path="config.toml"):
    with open(path, "rb") as f:
        return tomllib.load(f)


def main(split):
    from objective import measure

    seed = int(os.environ.get("GROVE_SEED", "0"))
    print(json.dumps(measure(load(), split, seed)))
"""


@dataclass(frozen=True)
class Study:
    name: str
    about: str
    metric: str
    maximize: bool
    config: str
    objective: str
    search: dict[str, str]
    constraints: list[dict[str, Any]] = field(default_factory=list)
    null: bool = False
    # key -> (parent key, value): the key is read only where the parent holds that value. Grove's
    # spec says so with `when`; Optuna's baselines suggest the key define-by-run, only when the
    # parent takes that value.
    conditions: dict[str, tuple[str, Any]] = field(default_factory=dict)

    def spec(
        self,
        seed: int,
        experiments: int,
        parallel: int,
        max_repeats: int | None = None,
        sampler: str = "auto",
        finish: float | None = None,
        widen: bool = True,
    ) -> str:
        """Return the study's grove.toml."""
        cons = "".join(
            f'\n[[constraints]]\nname = "{c["name"]}"\nmetric = "{c["metric"]}"\n'
            + "".join(f"{k} = {c[k]}\n" for k in ("min", "max") if k in c)
            for c in self.constraints
        )

        def dim(k: str, v: str) -> str:
            if k not in self.conditions:
                return v
            parent, value = self.conditions[k]
            return (
                v.rstrip().removesuffix("}")
                + f', when = {{ "config.toml:{parent}" = {json.dumps(value)} }} }}'
            )

        search = "".join(f'"config.toml:{k}" = {dim(k, v)}\n' for k, v in self.search.items())
        return (
            textwrap.dedent(f"""\
            [study]
            name = "bench-{self.name}-{seed}"
            goal = "{self.about}"
            base = "main"

            [objective]
            metric = "{self.metric}"
            direction = "{"maximize" if self.maximize else "minimize"}"

            [evaluate]
            dev = "python3 eval_dev.py"
            test = "python3 eval_test.py"
            timeout = 60
            repeats = 3
            {"" if max_repeats is None else f"max_repeats = {max_repeats}"}

            [files]
            editable = ["config.toml"]
            protected = ["objective.py", "bench.py", "eval_dev.py"]
            sealed = ["eval_test.py"]
            """)
            + cons
            + "\n[search]\n"
            + search
            + textwrap.dedent(f"""
            [budget]
            experiments = {experiments}
            parallel = {parallel}
            hours = 1.0
            usd = 0.0

            [gate]
            mode = "auto"

            [policy]
            kind = "search"
            sampler = "{sampler}"
            seed = {seed}
            {"" if finish is None else f"finish = {finish}"}
            {"" if widen else "widen = false"}

            [plateau]
            warn = 1000
            change = 1000
            stop = 1000
            """)
        )

    def make_repo(
        self,
        path: Path,
        seed: int,
        experiments: int,
        parallel: int,
        max_repeats: int | None = None,
        sampler: str = "auto",
        finish: float | None = None,
        widen: bool = True,
    ) -> Path:
        """Write the study as a one-commit git repository on branch main."""
        path.mkdir(parents=True, exist_ok=True)
        files = {
            "config.toml": textwrap.dedent(self.config),
            "objective.py": "from bench import SALT, gauss, noise\nimport math\n\n"
            + textwrap.dedent(self.objective),
            "bench.py": BENCH.replace("SALT = 0", f"SALT = {seed}"),
            "eval_dev.py": 'from bench import main\n\nmain("dev")\n',
            "eval_test.py": 'from bench import main\n\nmain("test")\n',
            "grove.toml": self.spec(seed, experiments, parallel, max_repeats, sampler, finish, widen),
        }
        for name, text in files.items():
            (path / name).write_text(text)
        env_git = [
            "-c",
            "user.name=bench",
            "-c",
            "user.email=bench@localhost",
            "-c",
            "init.defaultBranch=main",
        ]
        for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", f"{self.name} study"]):
            subprocess.run(["git", *env_git, *cmd], cwd=path, check=True)
        return path


SMOOTH = Study(
    name="smooth",
    about="Raise the score of a smooth, unconstrained three-knob objective",
    metric="score",
    maximize=True,
    config="""\
        [train]
        lr = 0.3
        momentum = 0.0
        [model]
        dropout = 0.5
        """,
    objective="""\
        def measure(cfg, split, seed):
            t, m = cfg["train"], cfg["model"]
            f = 1.0 - 0.08 * (math.log10(t["lr"]) + 2.3) ** 2 - 0.6 * (t["momentum"] - 0.9) ** 2
            f -= 0.5 * (m["dropout"] - 0.15) ** 2
            return {"score": f + noise(cfg, split, seed, 0.01)}
        """,
    search={
        "train.lr": "{ low = 1e-4, high = 1.0, log = true }",
        "train.momentum": "{ low = 0.0, high = 0.99 }",
        "model.dropout": "{ low = 0.0, high = 0.8 }",
    },
)

CONSTRAINED = Study(
    name="constrained",
    about="Raise accuracy without growing past 50k parameters",
    metric="accuracy",
    maximize=True,
    config="""\
        [model]
        width = 16
        depth = 2
        share = false
        [train]
        lr = 0.01
        """,
    objective="""\
        def measure(cfg, split, seed):
            m, t = cfg["model"], cfg["train"]
            w, d, share = m["width"], m["depth"], m["share"]
            params = w * w * (1 if share else d) + 10 * w
            capacity = math.log2(w) + 1.5 * math.log2(1 + d) * (0.7 if share else 1.0)
            acc = 0.5 + 0.05 * capacity - 0.05 * (math.log10(t["lr"]) + 2.5) ** 2
            return {"accuracy": acc + noise(cfg, split, seed, 0.01), "n_params": params}
        """,
    search={
        "model.width": "{ low = 8, high = 256 }",
        "model.depth": "{ low = 1, high = 8 }",
        "model.share": "{ values = [false, true] }",
        "train.lr": "{ low = 1e-4, high = 1e-1, log = true }",
    },
    constraints=[{"name": "size", "metric": "n_params", "max": 50000}],
)

CATEGORICAL = Study(
    name="categorical",
    about="Lower the loss by choosing optimizer, activation, normalisation and schedule",
    metric="loss",
    maximize=False,
    config="""\
        [train]
        optimizer = "sgd"
        schedule = "constant"
        warmup = 0
        [model]
        activation = "sigmoid"
        norm = "none"
        """,
    objective="""\
        OPT = {"sgd": 0.0, "momentum": -0.1, "adam": -0.25, "adamw": -0.3, "lion": -0.05}
        ACT = {"relu": -0.1, "gelu": -0.15, "tanh": 0.05, "sigmoid": 0.0, "silu": -0.12}
        NORM = {"none": 0.0, "batch": -0.1, "layer": -0.08}
        SCHED = {"constant": 0.0, "cosine": -0.08, "step": -0.03, "linear": -0.05}

        def measure(cfg, split, seed):
            t, m = cfg["train"], cfg["model"]
            loss = 1.0 + OPT[t["optimizer"]] + ACT[m["activation"]] + NORM[m["norm"]] + SCHED[t["schedule"]]
            if t["optimizer"] in ("adam", "adamw") and m["norm"] == "batch":
                loss += 0.12
            if m["norm"] == "layer" and m["activation"] == "gelu":
                loss -= 0.07
            if t["optimizer"] in ("adam", "adamw"):
                loss -= 0.01 * min(t["warmup"], 5) - 0.004 * max(t["warmup"] - 5, 0)
            return {"loss": loss + noise(cfg, split, seed, 0.02)}
        """,
    search={
        "train.optimizer": '{ values = ["sgd", "momentum", "adam", "adamw", "lion"] }',
        "train.schedule": '{ values = ["constant", "cosine", "step", "linear"] }',
        "train.warmup": "{ low = 0, high = 10 }",
        "model.activation": '{ values = ["relu", "gelu", "tanh", "sigmoid", "silu"] }',
        "model.norm": '{ values = ["none", "batch", "layer"] }',
    },
)

TRAP = Study(
    name="trap",
    about="Raise the score on a noisy objective where tuning the threshold on dev overfits",
    metric="score",
    maximize=True,
    config="""\
        [data]
        augment = 0.0
        [train]
        epochs = 5
        [eval]
        threshold_tune = 0.0
        """,
    objective="""\
        def measure(cfg, split, seed):
            aug, ep, thr = cfg["data"]["augment"], cfg["train"]["epochs"], cfg["eval"]["threshold_tune"]
            f = 0.6 + 0.1 * aug - 0.00025 * (ep - 20) ** 2
            # Tuning the decision threshold on the dev set fits its noise: dev rises, held-out falls.
            f += 0.15 * thr if split == "dev" else -0.3 * thr
            return {"score": f + noise(cfg, split, seed, 0.03)}
        """,
    search={
        "data.augment": "{ low = 0.0, high = 1.0 }",
        "train.epochs": "{ low = 1, high = 50 }",
        "eval.threshold_tune": "{ low = 0.0, high = 1.0 }",
    },
)

NULL = Study(
    name="null",
    about="Nothing to find: the knobs have no effect, only noise",
    metric="score",
    maximize=True,
    config="""\
        [model]
        a = 0.5
        b = 4
        c = "x"
        """,
    objective="""\
        def measure(cfg, split, seed):
            return {"score": 0.7 + noise(cfg, split, seed, 0.02)}
        """,
    search={
        "model.a": "{ low = 0.0, high = 1.0 }",
        "model.b": "{ low = 1, high = 16 }",
        "model.c": '{ values = ["x", "y", "z"] }',
    },
    null=True,
)

CONDITIONAL = Study(
    name="conditional",
    about="Lower the loss by choosing an optimizer and the learning rate of the one chosen",
    metric="loss",
    maximize=False,
    config="""\
        [train]
        optimizer = "sgd"
        sgd_lr = 0.5
        momentum_lr = 0.5
        adam_lr = 0.05
        weight_decay = 0.0
        """,
    objective="""\
        # Each optimizer's best loss and the log10 learning rate that reaches it.
        BEST = {"sgd": (0.40, -1.0), "momentum": (0.32, -1.7), "adam": (0.25, -3.0)}

        def measure(cfg, split, seed):
            t = cfg["train"]
            floor, at = BEST[t["optimizer"]]
            lr = t[t["optimizer"] + "_lr"]  # only the chosen optimizer's learning rate is read
            loss = floor + 0.06 * (math.log10(lr) - at) ** 2 + 8.0 * (t["weight_decay"] - 0.02) ** 2
            return {"loss": loss + noise(cfg, split, seed, 0.01)}
        """,
    search={
        "train.optimizer": '{ values = ["sgd", "momentum", "adam"] }',
        "train.sgd_lr": "{ low = 1e-5, high = 1.0, log = true }",
        "train.momentum_lr": "{ low = 1e-5, high = 1.0, log = true }",
        "train.adam_lr": "{ low = 1e-5, high = 1.0, log = true }",
        "train.weight_decay": "{ low = 0.0, high = 0.1 }",
    },
    conditions={
        "train.sgd_lr": ("train.optimizer", "sgd"),
        "train.momentum_lr": ("train.optimizer", "momentum"),
        "train.adam_lr": ("train.optimizer", "adam"),
    },
)
"""A conditional space: each optimizer has its own learning rate, and only the chosen one's matters.

Switching optimizer pays only together with that optimizer's learning rate (Adam at the base's
0.05 is barely better than SGD at 0.5). Every method searches it define-by-run: the optimizer
first, then only its learning rate (`Study.conditions`, which Grove's spec states with `when`);
the others keep the base's values in config.toml.
"""

MIXED = Study(
    name="mixed",
    about="Raise accuracy under a latency budget: dev accuracy is deterministic, latency and held-out are noisy",
    metric="accuracy",
    maximize=True,
    config="""\
        [model]
        width = 64
        bits = 16
        [train]
        smoothing = 0.0
        """,
    objective="""\
        QUANT = {4: 0.06, 8: 0.01, 16: 0.0}  # accuracy lost to quantisation

        def measure(cfg, split, seed):
            m, t = cfg["model"], cfg["train"]
            acc = 0.55 + 0.06 * math.log2(m["width"] / 16) - QUANT[m["bits"]] - 0.8 * (t["smoothing"] - 0.1) ** 2
            if split == "test":  # the held-out evaluation is noisy; dev is the same number for every seed
                acc += noise(cfg, split, seed, 0.01)
            # Latency is timed: 5% noise on every split and seed.
            latency = (0.5 + m["width"] * m["bits"] / 200) * (1 + 0.05 * gauss(SALT, split, seed, cfg, "latency"))
            return {"accuracy": acc, "latency_ms": latency}
        """,
    search={
        "model.width": "{ low = 16, high = 512, log = true }",
        "model.bits": "{ values = [4, 8, 16] }",
        "train.smoothing": "{ low = 0.0, high = 0.3 }",
    },
    constraints=[{"name": "latency", "metric": "latency_ms", "max": 8.0}],
)
"""Deterministic and noisy evaluators in one study.

The dev accuracy is a deterministic evaluator (the same value for every seed: paired seeds show
no spread at all), the held-out accuracy and the latency on both splits are noisy. The best
configurations sit on the latency bound, where a configuration that met it on its dev seeds may
break it on others.
"""

STUDIES = {s.name: s for s in (SMOOTH, CONSTRAINED, CATEGORICAL, TRAP, CONDITIONAL, MIXED, NULL)}
