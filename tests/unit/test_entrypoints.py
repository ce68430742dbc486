"""How `grove init` reads a training script's command line: argparse, click and typer."""

from __future__ import annotations

from pathlib import Path

from agents import entrypoints

CLICK = """\
import click

@click.command()
@click.argument("config_path")
@click.option("--lr", "-l", default=0.01, type=float)
@click.option("--log-every", default=10)
def main(config_path, lr, log_every):
    print("val_loss:", lr)

if __name__ == "__main__":
    main()
"""

TYPER = """\
import typer

def main(config: str, learning_rate: float = 0.01, epochs: int = typer.Option(5, "--epochs", "-e"),
         name: str = typer.Option(..., "--name")):
    print("loss=", learning_rate)

if __name__ == "__main__":
    typer.run(main)
"""

ARGPARSE = """\
import argparse
p = argparse.ArgumentParser()
p.add_argument("--cfg", required=True)
p.add_argument("--batch-size", type=int, default=32)
print("acc:", p.parse_args().batch_size)
"""


def test_click_options_become_slots_and_its_config_argument_gets_the_config_file() -> None:
    ep = entrypoints.find({"train.py": CLICK, "config.yaml": "a: 1\n"})
    assert ep is not None and ep.kind == "click"
    assert ep.command == ["python", "train.py", "config.yaml", "--lr", "{lr}", "--log-every", "{log_every}"]
    assert ep.params == {"lr": 0.01, "log_every": 10} and ep.printed == ["val_loss"]


def test_typer_parameters_become_slots_and_a_required_option_is_a_todo() -> None:
    ep = entrypoints.find({"train.py": TYPER, "conf/params.yaml": "a: 1\n"})
    assert ep is not None and ep.kind == "typer"
    assert ep.command == [
        "python", "train.py", "conf/params.yaml", "--learning-rate", "{learning_rate}", "--epochs", "{epochs}",
        "--name", "TODO",
    ]  # fmt: skip
    assert ep.params == {"learning_rate": 0.01, "epochs": 5}
    assert any("needs --name; TODO" in n for n in ep.notes)


def test_argparse_required_config_flag_gets_the_config_file() -> None:
    ep = entrypoints.find({"main.py": ARGPARSE, "params.yaml": "a: 1\n"})
    assert ep is not None and ep.kind == "argparse"
    assert ep.command == ["python", "main.py", "--cfg", "params.yaml", "--batch-size", "{batch_size}"]


def test_a_data_file_of_rows_larger_than_a_text_file_is_still_read_for_the_split(tmp_path: Path) -> None:
    from backend.services.studies import MAX_INTAKE_BYTES, repository_files

    rows = "x,y\n" + "".join(f"{i},{i % 7}\n" for i in range(60_000))
    assert len(rows) > MAX_INTAKE_BYTES
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "big.csv").write_text(rows)
    (tmp_path / "notes.md").write_text("#" * (MAX_INTAKE_BYTES + 1))
    files = repository_files(tmp_path)
    assert files["data/big.csv"] == rows and "notes.md" not in files
    dev, held = entrypoints.split_rows("data/big.csv", rows)
    assert dev.startswith("x,y\n") and held.startswith("x,y\n") and held.count("\n") == 20_001


def test_odd_repositories_get_a_draft_not_a_crash() -> None:
    from agents import intake
    from agents.spec import parse_spec

    app = 'import hydra\n@hydra.main(config_path=CONF, config_name="config")\ndef main(cfg):\n    print("acc:", 1)\n'
    odd = [
        {"app.py": app.replace("CONF", '"conf"'), "conf/config.yaml": "defaults: null\nlr: 0.1\n"},
        {"app.py": app.replace("CONF", '"conf"'), "conf/config.yaml": "defaults: [\n  - x: {\n"},
        {"app.py": app.replace("CONF", "1"), "config.yaml": "lr: 0.1\n"},
        {"MLproject": "entry_points:\n  main:\n    parameters: [alpha]\n    command: python train.py\n"},
        {"MLproject": "entry_points:\n  main:\n    command: python missing.py {a}\n"},
        {"train.py": "import typer\ndef main(a=1, /, lr=0.1):\n    print('loss:', lr)\ntyper.run(main)\n"},
    ]
    for files in odd:
        c = intake.draft(files, "odd", "keep it below 1e999 parameters")
        parse_spec(intake.render(c))  # a spec that parses, whatever the repository held
