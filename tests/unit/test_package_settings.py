"""What of the operator's package-index settings a setup box gets: never credentials, never Grove's data."""

from __future__ import annotations

from pathlib import Path

from backend.engine.environment import package_settings


def test_index_settings_and_the_files_they_name_pass_credentials_do_not(tmp_path: Path) -> None:
    wheels, data = tmp_path / "opt" / "wheels", tmp_path / "grove" / "data"
    wheels.mkdir(parents=True)
    data.mkdir(parents=True)
    ca = tmp_path / "ca" / "bundle.pem"
    ca.parent.mkdir()
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    conf = tmp_path / "pip" / "pip.conf"
    conf.parent.mkdir()
    conf.write_text(f"[global]\nfind-links = file://{wheels}\nconstraint = {data}/c.txt\n")
    env, paths = package_settings(
        {
            "PIP_DEFAULT_TIMEOUT": "60",
            "PIP_INDEX_URL": "https://ada:s3cret@pypi.example/simple",  # credentials in a URL
            "PIP_EXTRA_INDEX_URL": "https://pypi.example/simple",
            "PIP_TOKEN": "x",  # a secret-looking name
            "SSL_CERT_FILE": str(ca),
            "PIP_CONFIG_FILE": str(conf),
            "PIP_FIND_LINKS": "/",  # the root is never bound
            "UV_INDEX_URL": "https://pypi.example/simple?access_token=abc",  # a token in the query
            "PIP_CLIENT_CERT": str(ca),  # not a setting that passes
            "HOME": "/root",
        },
        keep_out=(data,),
    )
    assert env == {
        "PIP_DEFAULT_TIMEOUT": "60",
        "PIP_EXTRA_INDEX_URL": "https://pypi.example/simple",
        "SSL_CERT_FILE": str(ca),
        "PIP_CONFIG_FILE": str(conf),
        "PIP_FIND_LINKS": "/",
    }
    assert str(ca) in paths and str(conf) in paths and str(wheels) in paths
    assert "/" not in paths and not any(p.startswith(str(data)) for p in paths)


def test_a_config_file_holding_credentials_is_left_out(tmp_path: Path) -> None:
    conf = tmp_path / "pip" / "pip.conf"
    conf.parent.mkdir()
    conf.write_text("[global]\nindex-url = https://ada:s3cret@pypi.example/simple\n")
    env, paths = package_settings({"PIP_CONFIG_FILE": str(conf)})
    assert "PIP_CONFIG_FILE" not in env and str(conf) not in paths


def test_home_folders_folders_holding_keys_and_private_keys_are_never_bound(tmp_path: Path) -> None:
    home, keys, wheels = tmp_path / "home" / "op", tmp_path / "keys", tmp_path / "opt" / "wheels"
    for d in (home / ".ssh", keys / ".aws", wheels):
        d.mkdir(parents=True)
    key = tmp_path / "pki" / "client.pem"
    key.parent.mkdir()
    key.write_text("-----BEGIN RSA PRIVATE KEY-----\n")
    env, paths = package_settings(
        {
            "HOME": str(home),
            "PIP_FIND_LINKS": f"{home} {keys} {wheels} {tmp_path / 'home'}",
            "SSL_CERT_FILE": str(key),
        }
    )
    assert str(wheels) in paths
    assert not any(p in (str(home), str(keys), str(key), str(tmp_path / "home")) for p in paths)
    assert "SSL_CERT_FILE" not in env
