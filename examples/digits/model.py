"""The model under study: a small multi-layer perceptron configured by config.toml."""

import itertools
import tomllib
import warnings

from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler


def load_config(path="config.toml"):
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def build(config, seed):
    m, t = config["model"], config["train"]
    mlp = MLPClassifier(
        hidden_layer_sizes=(int(m["hidden"]),) * int(m["layers"]),
        learning_rate_init=float(t["lr"]),
        alpha=float(t["alpha"]),
        max_iter=int(t["epochs"]),
        random_state=seed,
    )
    return make_pipeline(StandardScaler(), mlp)


def n_params(config, n_features=64, n_classes=10):
    sizes = [n_features] + [int(config["model"]["hidden"])] * int(config["model"]["layers"]) + [n_classes]
    return sum(a * b + b for a, b in itertools.pairwise(sizes))


def fit(model, X, y):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return model.fit(X, y)
