"""Predict the held-out digits: train the model on data/train.csv, write a label per input row.

The first phase of the sealed test. It runs the model's (editable) code where the held-out
inputs are present and their labels are not, and writes $GROVE_OUTPUTS/predictions.csv;
score.py, which never runs editable code, compares it with the labels.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import model
import numpy as np


def main():
    seed = int(os.environ.get("GROVE_SEED", "0"))
    train = np.loadtxt("data/train.csv", delimiter=",", skiprows=1)
    inputs = np.loadtxt("data/test/inputs.csv", delimiter=",", skiprows=1)
    clf = model.fit(model.build(model.load_config(), seed), train[:, :-1], train[:, -1].astype(int))
    out = os.path.join(os.environ["GROVE_OUTPUTS"], "predictions.csv")
    np.savetxt(out, clf.predict(inputs).astype(int), fmt="%d", header="label", comments="")


if __name__ == "__main__":
    main()
