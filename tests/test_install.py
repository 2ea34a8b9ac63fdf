"""``make install`` installs constraints.txt's versions: the venv and the file agree, both ways.

A package missing from the file (a new dependency's, or one a new pin pulls in) would float to
whatever its registry has on the day of a fresh clone; a line the venv does not match means the
file was not rewritten (``make lock``) after pyproject.toml changed.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

CONSTRAINTS = Path(__file__).resolve().parents[1] / "constraints.txt"


def _name(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[_name(name)] = version
    return pins


def _installed() -> dict[str, str]:
    found = {_name(d.metadata["Name"]): d.version.split("+", 1)[0]
             for d in importlib.metadata.distributions()}
    for own in ("fedgc", "pip"):  # the project itself (editable) and the installer
        found.pop(own, None)
    return found


def test_every_installed_package_is_pinned_at_its_version() -> None:
    pins, here = _pins(), _installed()
    unpinned = sorted(set(here) - set(pins))
    moved = {name: (pins[name], version) for name, version in here.items()
             if name in pins and pins[name] != version}
    assert not unpinned, f"installed, not in constraints.txt (run `make lock`): {unpinned}"
    assert not moved, f"constraints.txt: (pinned, installed here) {moved}; run `make install`"


def test_every_pin_is_installed() -> None:
    missing = sorted(set(_pins()) - set(_installed()))
    assert not missing, f"constraints.txt pins what the venv lacks (run `make lock`): {missing}"


def test_pyprojects_own_pins_are_the_files() -> None:
    """Every ``name==version`` (extras dropped) of pyproject.toml's dependencies is pinned at
    that version in constraints.txt: a pin moved in one and not the other would make pip refuse
    the install, or the file lie about what it installs."""
    import tomllib

    project = tomllib.loads((CONSTRAINTS.parent / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"],
             *(s for group in project.get("optional-dependencies", {}).values() for s in group)]
    pins, theirs = _pins(), {}
    for spec in specs:
        if "==" in spec:
            name, version = spec.split("==")
            theirs[_name(name.split("[", 1)[0])] = version.split(";", 1)[0].strip()
    assert theirs and {k: pins.get(k) for k in theirs} == theirs
