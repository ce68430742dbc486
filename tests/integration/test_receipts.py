from __future__ import annotations

from pathlib import Path

import pytest

from backend.engine import evaluation, sandbox


def receipt(tmp_path: Path, script: str, metric: str = "score") -> evaluation.Receipt:
    (tmp_path / "e.py").write_text(script)
    return evaluation.evaluate(
        kind="dev", command="python3 e.py", worktree=tmp_path, output_dir=tmp_path / "out", seed=2,
        metric=metric, commit="abc", limits=sandbox.Limits(timeout=5), evaluator_fingerprint="fp",
    )  # fmt: skip


def test_metrics_from_last_json_line(tmp_path: Path) -> None:
    r = receipt(
        tmp_path,
        'import os\nprint({"not": "json"})\nprint(\'{"score": 1}\')\nprint(\'{"score": 0.5, "seed": %s}\' % os.environ["GROVE_SEED"])\nprint("done")',
    )
    assert r.ok and r.metrics == {"score": 0.5, "seed": 2} and r.objective("score") == 0.5
    assert r.commit == "abc" and r.fingerprint == "fp" and r.exit_code == 0 and r.duration > 0


def test_metrics_file_wins_over_stdout(tmp_path: Path) -> None:
    r = receipt(
        tmp_path,
        'import os, json\njson.dump({"score": 3}, open(os.environ["GROVE_METRICS_FILE"], "w"))\nprint(\'{"score": 1}\')',
    )
    assert r.ok and r.metrics == {"score": 3}


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        ("import sys\nprint('{\"score\": 1}')\nsys.exit(3)", "exited with code 3"),
        ("print('hello')", "no metrics"),
        ("import os\nopen(os.environ['GROVE_METRICS_FILE'], 'w').write('{bad json')", "not valid JSON"),
        (
            "import os\nopen(os.environ['GROVE_METRICS_FILE'], 'w').write('[1, 2]')",
            "does not hold a JSON object",
        ),
        ("print('{\"loss\": 1}')", "objective metric 'score' missing"),
        ('print(\'{"score": "high"}\')', "not a finite number"),
        ("print('{\"score\": NaN}')", "not a finite number"),
        ("import time\ntime.sleep(30)", "timed out after 5s"),
        # Nested past the JSON parser's depth: not metrics, and no exception escapes to leave a job running.
        ("print('{\"a\": ' * 100000 + '1' + '}' * 100000)", "no metrics"),
        (
            "import os\nopen(os.environ['GROVE_METRICS_FILE'], 'w').write('[' * 100000 + ']' * 100000)",
            "nested too deeply",
        ),
    ],
)
def test_failed_receipts_carry_the_reason(tmp_path: Path, script: str, reason: str) -> None:
    r = receipt(tmp_path, script)
    assert not r.ok and reason in r.reason
    assert r.objective("score") is None
    assert Path(r.stdout_path).exists() and Path(r.stderr_path).exists()


def test_fingerprint_tracks_evaluator_files(tmp_path: Path) -> None:
    (tmp_path / "eval.py").write_text("a")
    (tmp_path / "model.py").write_text("b")
    fp = evaluation.fingerprint(tmp_path, ["eval.py"])
    (tmp_path / "model.py").write_text("changed")
    assert evaluation.fingerprint(tmp_path, ["eval.py"]) == fp
    (tmp_path / "eval.py").write_text("changed")
    assert evaluation.fingerprint(tmp_path, ["eval.py"]) != fp


def test_step_records_before_the_metrics_line_are_the_curves(tmp_path: Path) -> None:
    script = (
        "import json\n"
        "print(json.dumps({'lr': 0.001}))\n"  # a config line: neither a step nor the metrics
        "for step in range(0, 50, 10):\n"
        "    print(json.dumps({'step': step, 'loss': 1 / (step + 1), 'phase': 'train'}))\n"
        "print(json.dumps({'score': 0.75}))\n"
    )
    r = receipt(tmp_path, script)
    assert r.ok and r.metrics == {"score": 0.75}
    records = evaluation.step_records(Path(r.stdout_path).read_text())
    assert [x["step"] for x in records] == [0, 10, 20, 30, 40]
    assert records[1] == {"step": 10.0, "loss": 1 / 11}  # numbers only
    long = "\n".join(f'{{"step": {i}, "loss": {i}}}' for i in range(5000))
    thinned = evaluation.step_records(long, limit=100)
    assert len(thinned) == 100 and thinned[0]["step"] == 0 and thinned[-1]["step"] == 4950
    # As before step records existed, the last JSON line is the metrics, a step record or not.
    only_steps = receipt(tmp_path, 'print(\'{"lr": 0.1}\')\nprint(\'{"step": 3, "score": 0.5}\')')
    assert only_steps.metrics == {"step": 3, "score": 0.5}


def test_hostile_step_lines_are_left_out_not_a_crash() -> None:
    huge = "9" * 400
    text = "\n".join([
        f'{{"step": 1, "loss": {huge}}}',  # past a float: that value is left out
        f'{{"step": {huge}, "loss": 1}}',  # a step past a float: not a step record
        '{"step": 2, "loss": ' + "1" * 5000 + "}",  # past Python's int-string limit: not JSON here
        '{"step": 3, "loss": NaN, "acc": 0.5, "name": "x"}',
        '{"step": true, "loss": 1}',
        '{"step": 4, ' + ", ".join(f'"k{i}": {i}' for i in range(100)) + "}",
    ])  # fmt: skip
    records = evaluation.step_records(text)
    assert [r["step"] for r in records] == [1, 3, 4]
    assert records[0] == {"step": 1.0} and records[1] == {"step": 3.0, "acc": 0.5}
    assert (
        len(records[2]) == evaluation.STEP_KEYS and records[2]["k30"] == 30
    )  # the first keys, step among them
