"""A value in TOML syntax, for Flower's `--run-config`, `--node-config` and `pyproject.toml`."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from .errors import DeployError


def toml_value(key: str, value: object) -> str:
    """``value`` as a TOML value (bool, int, finite float, string).

    Raises
    ------
    DeployError
        For a non-finite float (Flower's run config cannot carry one, and a run that reads
        ``inf`` where a number of seconds or a rate is meant is not what the user asked for) or
        another type; the message names ``key``.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DeployError(f"config {key}={value!r}: expected a finite number (a Flower run "
                              f"or node config cannot carry it)")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise DeployError(f"config {key}={value!r}: expected bool, int, float or str")


def format_config(config: Mapping[str, object]) -> str:
    """``k=v`` pairs in the TOML value syntax ``--node-config`` and ``--run-config`` accept."""
    return " ".join(f"{key}={toml_value(key, value)}" for key, value in config.items())
