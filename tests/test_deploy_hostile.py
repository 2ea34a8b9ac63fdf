"""The deployment kit against careless use: private files and folders, signals, config values."""

from __future__ import annotations

import os
import pathlib
import stat
from pathlib import Path

import pytest

from simulations.deploy.certs import make_node_keys, make_tls
from simulations.deploy.errors import DeployError
from simulations.deploy.fedgc_app import write_app
from simulations.deploy.toml_values import format_config


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_are_created_0600_and_folders_0700_even_with_a_permissive_umask(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_chmod(self: Path, mode: int, **kw: object) -> None:
        raise AssertionError(f"{self} chmod-ed to {oct(mode)} after it was written")

    monkeypatch.setattr(pathlib.Path, "chmod", no_chmod)
    old = os.umask(0o002)
    try:
        tls = make_tls(tmp_path / "work" / "tls", ["127.0.0.1"])
        keys = make_node_keys(tmp_path / "work" / "keys", "node0")
        app = write_app(tmp_path / "work" / "app-1.0.0", {"rounds": 2})
        (tmp_path / "work" / "tls" / "server.key").write_bytes(b"stale")
        again = make_tls(tmp_path / "work" / "tls", ["127.0.0.1"])  # replaces the old files
    finally:
        os.umask(old)
    for key in (tls.server_key, keys.private_key, again.server_key):
        assert _mode(key) == 0o600, key
    assert again.server_key.read_bytes() != b"stale"
    for folder in (tmp_path / "work", tls.ca_cert.parent, keys.private_key.parent, app):
        assert _mode(folder) == 0o700, folder


def test_one_toml_formatter_refuses_non_finite_numbers() -> None:
    assert format_config({"a": 1, "b": 0.5, "c": True, "d": "x y"}) == 'a=1 b=0.5 c=true d="x y"'
    for bad in (float("inf"), float("nan")):
        with pytest.raises(DeployError, match="round_timeout_s=.*expected a finite number"):
            format_config({"round_timeout_s": bad})
    with pytest.raises(DeployError, match=r"k=\[1\]: expected bool, int, float or str"):
        format_config({"k": [1]})
