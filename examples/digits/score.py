"""Score the held-out predictions: the second phase of the sealed test (standard library only).

It sees the study's protected and sealed files and the predict phase's outputs, never a file a
change may edit; it reads the predictions as data (no import, no unpickling) and prints accuracy.
"""

import csv
import json
import os
import sys


def labels(path):
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    return [row[0].strip() for row in rows[1:] if row]


def main():
    truth = labels("data/test/labels.csv")
    try:
        predicted = labels(os.path.join(os.environ["GROVE_OUTPUTS"], "predictions.csv"))
    except OSError as exc:
        sys.exit(f"no predictions: {exc}")
    if len(predicted) != len(truth):
        sys.exit(f"{len(predicted)} predictions for {len(truth)} held-out rows")
    accuracy = sum(p == t for p, t in zip(predicted, truth, strict=True)) / len(truth)
    print(json.dumps({"accuracy": round(accuracy, 6)}))


if __name__ == "__main__":
    main()
