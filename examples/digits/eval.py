"""Evaluate the classifier on the dev split: train on data/train.csv, report accuracy as JSON.

Usage: python eval.py --split dev   (GROVE_SEED picks the training seed). The sealed test split is
scored in two phases instead (predict.py, then score.py), so that the model's code never runs
beside the held-out labels.
"""

import argparse
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import model
import numpy as np

SPLITS = {"dev": "data/dev.csv"}


def load(path):
    data = np.loadtxt(path, delimiter=",", skiprows=1)
    return data[:, :-1], data[:, -1].astype(int)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--split", choices=sorted(SPLITS), required=True)
    args = parser.parse_args()
    seed = int(os.environ.get("GROVE_SEED", "0"))
    config = model.load_config()
    X, y = load("data/train.csv")
    Xe, ye = load(SPLITS[args.split])
    clf = model.fit(model.build(config, seed), X, y)
    accuracy = float((clf.predict(Xe) == ye).mean())
    print(json.dumps({"accuracy": round(accuracy, 6), "n_params": model.n_params(config)}))


if __name__ == "__main__":
    main()
