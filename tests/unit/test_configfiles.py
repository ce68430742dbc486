"""Config files: formats by name, override or content; YAML 1.2 edited in place; lists, Hydra, links."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agents import configfiles
from agents.policies import optuna_bridge
from agents.policies.base import ImplementInput
from agents.policies.search import ImplementationError, SearchPolicy
from agents.policies.space import Space
from agents.spec import parse_spec
from agents.speccheck import check_against_tree
from backend.core import gitops
from backend.engine.experiment import diff_title, key_values
from tests.support.inputs import edits_input
from tests.support.repos import make_repo, tiny_files


def test_yaml_is_read_as_1_2_and_a_change_rewrites_only_the_value() -> None:
    text = "train:\n  lr: 1e-3    # learning rate\n  on: yes\n  batch: 32\n"
    assert configfiles.get_key("c.yaml", text, "train.lr") == 0.001  # YAML 1.1 would read "1e-3"
    assert configfiles.get_key("c.yaml", text, "train.on") == "yes"
    new = configfiles.set_keys("c.yaml", text, {"train.lr": 0.0005, "train.batch": 32})
    assert new == "train:\n  lr: 0.0005    # learning rate\n  on: yes\n  batch: 32\n"


def test_list_indices_list_values_and_quoting_are_kept() -> None:
    text = 'model:\n  name: "mlp"\n  dims: [64, 64]\n  layers:\n    - width: 8\n    - width: 16\n'
    assert configfiles.get_key("m.yaml", text, "model.layers.1.width") == 16
    new = configfiles.set_keys(
        "m.yaml", text, {"model.layers.1.width": 32, "model.dims": [128, 128], "model.name": "cnn"}
    )
    assert new == 'model:\n  name: "cnn"\n  dims: [128, 128]\n  layers:\n    - width: 8\n    - width: 32\n'
    grown = configfiles.set_keys("m.yaml", text, {"model.dims": [32, 32, 32]})
    assert configfiles.get_key("m.yaml", grown, "model.dims") == [32, 32, 32]
    with pytest.raises(configfiles.ConfigKeyError):
        configfiles.get_key("m.yaml", text, "model.layers.7.width")
    toml = "[m]\nlayers = [1, 2]  # keep\n"
    assert configfiles.set_keys("m.toml", toml, {"m.layers.1": 5}) == "[m]\nlayers = [1, 5]  # keep\n"


def test_a_hydra_defaults_choice_is_a_dotted_key() -> None:
    text = "defaults:\n  - model: mlp  # group\n  - optimizer: adam\n  - _self_\nlr: 0.1\n"
    assert configfiles.get_key("config.yaml", text, "defaults.model") == "mlp"
    new = configfiles.set_keys("config.yaml", text, {"defaults.model": "cnn"})
    assert new == text.replace("model: mlp", "model: cnn")


def test_formats_come_from_the_override_the_name_or_the_content() -> None:
    assert configfiles.file_format("MLproject", "name: x\n", "yaml") == "yaml"
    assert configfiles.file_format("settings", '{"a": 1}') == "json"
    assert configfiles.file_format("Pipfile", "[a]\nb = 1\n") == "toml"
    assert configfiles.file_format("MLproject", "name: x\nentry_points: {}\n") == "yaml"
    with pytest.raises(configfiles.ConfigFormatError, match=r'\[files.formats\] "notes" = "yaml"'):
        configfiles.file_format("notes", "just some words")
    json_text = '{\n\t"a": {"b": 1}\n}\n'
    assert configfiles.set_keys("c.json", json_text, {"a.b": 2}) == '{\n\t"a": {\n\t\t"b": 2\n\t}\n}\n'


def with_search_file(spec: str, file: str, knob: str) -> str:
    """Return the tiny spec with `file` editable, its key `a` searched, and the knob's dimension `knob`."""
    spec = spec.replace('editable = ["config.toml"]', f'editable = ["config.toml", "{file}"]')
    return spec.replace("{ values = [0, 1, 2, 3, 4, 5] }", f'{knob}\n"{file}:a" = {{ values = [1, 2] }}')


def test_spec_check_names_an_unreadable_format_and_warns_on_out_of_range(tmp_path: Path) -> None:
    files = tiny_files()
    files["MLproject"] = "just words, no mapping\n"
    files["grove.toml"] = with_search_file(files["grove.toml"], "MLproject", "{ low = 1, high = 5 }")
    spec = parse_spec(files["grove.toml"])
    repo = gitops.Repo(make_repo(tmp_path / "r", files))
    issues = check_against_tree(spec, repo.files_at("HEAD"), lambda f: repo.read_followed("HEAD", f))
    by = {(i.key, i.level): i.message for i in issues}
    assert "cannot tell its format" in by[('search."MLproject:a"', "error")]
    assert "current value 0 lies outside [1, 5]" in by[('search."config.toml:knob.x"', "warning")]


def test_links_are_followed_inside_the_repository_only(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "r", {"real/params.yaml": "a: 1\n", "x.txt": "x"})
    (root / "params.yaml").symlink_to("real/params.yaml")
    (root / "escape.yaml").symlink_to("../../outside.yaml")
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", "commit", "-qm", "links"], cwd=root, check=True)
    repo = gitops.Repo(root)
    assert repo.read_at("HEAD", "params.yaml") == "real/params.yaml"  # git stores the link's text
    assert repo.read_followed("HEAD", "params.yaml") == "a: 1\n"
    with pytest.raises(ValueError, match="outside the repository"):
        repo.read_followed("HEAD", "escape.yaml")
    # Writing through a link edits its target, which must be editable too.
    SearchPolicy().implement(
        root,
        edits_input({"params.yaml:a": 2}, ["params.yaml", "real/**"]),
    )
    assert (root / "real/params.yaml").read_text() == "a: 2\n"
    with pytest.raises(ImplementationError, match=r"a link to real/params\.yaml, which is not editable"):
        SearchPolicy().implement(
            root,
            edits_input({"params.yaml:a": 3}, ["params.yaml"]),
        )


def test_a_title_reads_key_values_through_links_inside_the_worktree_only(tmp_path: Path) -> None:
    (tmp_path / "outside.yaml").write_text("a: 7\n")
    root = make_repo(tmp_path / "r", {"real/params.yaml": "a: 1\n"})
    (root / "params.yaml").symlink_to("real/params.yaml")
    files = tiny_files()
    spec = parse_spec(with_search_file(files["grove.toml"], "params.yaml", "{ values = [0, 1] }"))
    (root / "config.toml").write_text(files["config.toml"])
    keys = ["params.yaml:a", "config.toml:knob.x"]
    before = key_values(spec, root, keys)
    assert before == {"params.yaml:a": 1, "config.toml:knob.x": 0}
    (root / "real/params.yaml").write_text("a: 2\n")
    assert diff_title(before, key_values(spec, root, keys)) == "params.yaml:a 1 → 2"
    assert diff_title(before, before) == ""
    # A config that leads out of the worktree is never read: no title is made from it.
    (root / "params.yaml").unlink()
    (root / "params.yaml").symlink_to("../outside.yaml")
    assert key_values(spec, root, keys) is None
    (root / "params.yaml").unlink()
    (root / "params.yaml").symlink_to("params.yaml")  # a loop: no title, and no crash
    assert key_values(spec, root, keys) is None
    assert key_values(spec, root, ["not.searched"]) is None
    assert diff_title(before, None) == ""


def test_one_dimension_writes_every_target_and_list_values_reach_optuna(tmp_path: Path) -> None:
    (tmp_path / "MLproject").write_text("p:\n  alpha: {default: 0.5}  # mix\n")
    (tmp_path / "params.yaml").write_text("alpha: 0.5\n")
    targets = {"alpha": ["MLproject:p.alpha.default", "params.yaml:alpha"]}
    inp = ImplementInput(
        node_id=1,
        title="t",
        hypothesis={},
        edits={"alpha": 0.25},
        reflection="",
        editable=["*"],
        targets=targets,
        formats={"MLproject": "yaml"},
    )
    SearchPolicy().implement(tmp_path, inp)
    assert (tmp_path / "MLproject").read_text() == "p:\n  alpha: {default: 0.25}  # mix\n"
    assert (tmp_path / "params.yaml").read_text() == "alpha: 0.25\n"
    dims = {"m.yaml:dims": {"values": [[64, 64], [128, 128], [256]], "low": None, "high": None}}
    space = Space(dims, {"m.yaml:dims": [64, 64]})
    study = optuna_bridge.replay(space, [], [], maximize=True, sampler=optuna_bridge.make_sampler("tpe", 0))
    got = optuna_bridge.ask(study, space, 2, {space.key_of({"m.yaml:dims": [64, 64]})})
    assert sorted(map(str, (a["m.yaml:dims"] for a in got))) == ["[128, 128]", "[256]"]


def test_yaml_values_grove_cannot_edit_in_place_are_named_and_tags_and_empty_values_work() -> None:
    text = "base: &b\n  lr: 0.1\ntrain:\n  <<: *b\n  epochs: 3\nshared: &s 4\nalias: *s\n"
    with pytest.raises(configfiles.ConfigFormatError, match=r"train.lr: inherited through a merge key"):
        configfiles.check_settable("c.yaml", text, "train.lr")
    with pytest.raises(configfiles.ConfigFormatError, match=r"alias: the value is anchored \(&s\)"):
        configfiles.set_keys("c.yaml", text, {"alias": 5})
    configfiles.check_settable("c.yaml", text, "base.lr")  # where it is written: fine
    assert configfiles.set_keys("c.yaml", "x: !!float 1\ny:\nw: 2\n", {"x": 2.5, "y": 3}) == (
        "x: !!float 2.5\ny: 3\nw: 2\n"
    )
    with pytest.raises(configfiles.ConfigFormatError, match="share characters"):
        configfiles.set_keys("c.yaml", "a:\n  b: 1\n", {"a": {"b": 2}, "a.b": 3})
    assert configfiles.sniff("[" * 100_000) is None  # too deep for any parser: no crash


def test_a_search_file_linked_to_a_sealed_file_is_refused_at_validation(tmp_path: Path) -> None:
    from agents.spec import SpecError
    from backend.services.studies import check_spec

    files = tiny_files()
    files["data/test/params.yaml"] = "a: 1\n"
    files["grove.toml"] = with_search_file(
        files["grove.toml"], "params.yaml", "{ values = [0, 1, 2, 3, 4, 5] }"
    )
    root = make_repo(tmp_path / "r", files)
    (root / "params.yaml").symlink_to("data/test/params.yaml")
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", "commit", "-qm", "link"], cwd=root, check=True)
    with pytest.raises(SpecError) as err:
        check_spec(parse_spec(files["grove.toml"]), gitops.Repo(root))
    assert "params.yaml is a link to data/test/params.yaml, which is sealed" in str(err.value)
