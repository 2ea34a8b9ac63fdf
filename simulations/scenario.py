"""Named scenarios: the TOML files shipped in ``simulations/scenarios/``, loaded by name.

A scenario file holds the same flat keys as ``--set`` (TOML tables flatten: ``[dgc]
density = 0.001`` is ``dgc.density``), so a user copies one and edits it, then runs it with
``--config``. ``--scenario NAME`` loads ``simulations/scenarios/NAME.toml``; the keys it sets sit
between the defaults and ``--config`` (defaults < scenario < ``--config`` < ``--set``).
"""

from __future__ import annotations

from pathlib import Path

from fedgc.settings import TASKS, SettingsError, load_toml

__all__ = ["SCENARIO_DIR", "load_scenario", "scenario_names", "scenario_path"]

#: Where the shipped scenario files live (package data: installed with ``simulations``).
SCENARIO_DIR = Path(__file__).with_name("scenarios")


def scenario_names() -> list[str]:
    """The names of the shipped scenarios, sorted."""
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))


def scenario_path(name: str) -> Path:
    """The file of scenario ``name``; an unknown name lists the known ones."""
    known = scenario_names()
    if name not in known:
        task = (f"; {name!r} is a task: --set task={name} (a scenario is a file of keys, a "
                f"task one of them)" if name in TASKS else "")
        raise SettingsError(f"unknown scenario {name!r}{task}; known scenarios: "
                            f"{', '.join(known)} (files in {SCENARIO_DIR}; for your own file "
                            f"use --config FILE)")
    return SCENARIO_DIR / f"{name}.toml"


def load_scenario(name: str) -> dict[str, object]:
    """The flat keys of scenario ``name`` (validated later, with the run's other keys)."""
    return load_toml(scenario_path(name))
