"""Package settings that pass into setup boxes are parsed: no credentials in any URL form, no key folder at any depth."""

from __future__ import annotations

import os
from pathlib import Path

from backend.engine.environment import package_settings


def test_a_proxy_with_a_user_and_password_but_no_scheme_does_not_pass(tmp_path: Path) -> None:
    conf = tmp_path / "pip" / "pip.conf"
    conf.parent.mkdir()
    conf.write_text("[global]\nproxy = ada:s3cret@proxy.example:3128\n")
    env, paths = package_settings(
        {
            "PIP_PROXY": "ada:s3cret@proxy.example:3128",
            "UV_INDEX": "internal=ada:tok@pypi.example/simple",
            "PIP_EXTRA_INDEX_URL": "https://pypi.example/simple https://bob:pw@mirror.example/simple",
            "PIP_TRUSTED_HOST": "pypi.example",
            "PIP_CONFIG_FILE": str(conf),
        }
    )
    assert env == {"PIP_TRUSTED_HOST": "pypi.example"}
    assert str(conf) not in paths and "s3cret" not in " ".join(paths)


def test_a_file_inside_a_key_folder_named_directly_is_not_bound(tmp_path: Path) -> None:
    ssh = tmp_path / "srv" / "deploy" / ".ssh"
    ssh.mkdir(parents=True)
    for name in ("config", "known_hosts", "id_ed25519"):
        (ssh / name).write_text("Host *\n")
    env, paths = package_settings(
        {
            "PIP_CERT": str(ssh / "known_hosts"),
            "SSL_CERT_FILE": str(ssh / "config"),
            "PIP_CONSTRAINT": str(ssh / "id_ed25519"),
        }
    )
    assert not any(".ssh" in p for p in paths) and not any(".ssh" in v for v in env.values())


def test_a_find_links_folder_with_a_key_folder_nested_deeper_or_linked_is_not_bound(tmp_path: Path) -> None:
    nested = tmp_path / "opt" / "wheels"
    (nested / "sub" / "deeper" / ".aws").mkdir(parents=True)
    (nested / "sub" / "deeper" / ".aws" / "credentials").write_text("[default]\naws_secret_access_key=x\n")
    linked = tmp_path / "opt" / "linked"
    linked.mkdir()
    keys = tmp_path / "vault" / ".ssh"
    keys.mkdir(parents=True)
    os.symlink(keys, linked / "harmless")
    via_link = tmp_path / "opt" / "via-link"
    os.symlink(keys, via_link)  # the named folder is itself a link to a key folder
    fine = tmp_path / "opt" / "fine"
    fine.mkdir()
    (fine / "pkg-1.0-py3-none-any.whl").write_text("wheel")
    _, paths = package_settings({"PIP_FIND_LINKS": f"{nested} {linked} {via_link} {fine}"})
    assert [p for p in paths if p.startswith(str(tmp_path))] == [str(fine)]


def test_credentials_in_a_config_file_a_named_index_or_a_wrapped_url_do_not_pass(tmp_path: Path) -> None:
    conf = tmp_path / "pip" / "pip.conf"
    conf.parent.mkdir()
    conf.write_text("[global]\nindex-url=https://u:secret@pypi.example/simple\n")
    env, paths = package_settings(
        {
            "PIP_CONFIG_FILE": str(conf),
            "UV_INDEX": "corp=https://u:s@pypi.example/simple",
            "PIP_EXTRA_INDEX_URL": '"https://u:s@mirror.example/simple"',
            "UV_EXTRA_INDEX_URL": "(https://u:s@mirror.example/simple)",
            "UV_DEFAULT_INDEX": "<https://u:s@mirror.example/simple>",
        }
    )
    assert env == {} and str(conf) not in paths


def test_a_folder_holding_key_files_by_other_names_or_a_password_url_is_not_bound(tmp_path: Path) -> None:
    bound = []
    for name, text in ((".pgpass", "h:5432:db:u:pw\n"), (".npmrc", "//r/:_authToken=x\n"), ("id_rsa.bak", "k\n"),
                       ("notes.txt", "mirror: https://u:pw@mirror.example/\n"), ("README", "wheels\n")):  # fmt: skip
        folder = tmp_path / "opt" / name.strip(".").replace(".", "-")
        folder.mkdir(parents=True)
        (folder / name).write_text(text)
        bound.append(folder)
    _, paths = package_settings({"PIP_FIND_LINKS": " ".join(str(f) for f in bound)})
    assert [p for p in paths if p.startswith(str(tmp_path))] == [str(bound[-1])]
