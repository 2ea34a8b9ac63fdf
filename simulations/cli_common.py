"""What both command lines (``run``/``compare`` and ``deploy``) share: ``--config`` and
``--set`` parsing and the table of a run's headline numbers.

A module of its own so that ``simulations.cli`` and ``simulations.deploy.cli`` both import it
and neither imports the other's internals.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedgc.settings import SettingsError, load_toml

__all__ = ["load_config_file", "parse_sets", "summary_table"]


def load_config_file(path: str) -> dict[str, object]:
    """``--config FILE``'s keys; a folder, an unreadable or a non-UTF-8 file is named."""
    p = Path(path)
    if p.is_dir():
        raise SettingsError(f"--config {p} is a folder; expected a TOML file")
    try:
        return load_toml(p)
    except UnicodeDecodeError as ex:
        raise SettingsError(f"--config {p} is not UTF-8 text (byte {ex.start}); expected a "
                            f"TOML file") from ex
    except OSError as ex:
        raise SettingsError(f"--config {p} cannot be read: {ex.strerror or ex}") from ex


def parse_sets(items: Sequence[str]) -> dict[str, str]:
    """``["a=1", "dgc.density=0.01"]`` -> dict; an item without ``=`` names itself."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SettingsError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def summary_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """A plain-text table of the headline numbers of one or more runs."""
    head = (f"{'method':<8} {'final acc':>9} {'best acc':>9} {'uplink MB':>10} {'x dense':>8} "
            f"{'downlink MB':>11} {'failed':>6} {'wall s':>7}")
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        lines.append(
            f"{name:<8} {_fmt(s.get('final_accuracy'), '9.4f')} "
            f"{_fmt(s.get('best_accuracy'), '9.4f')} "
            f"{_fmt(s['uplink_bytes'] / 1e6, '10.3f')} {_fmt(s.get('uplink_compression'), '8.1f')} "
            f"{_fmt(s['downlink_bytes'] / 1e6, '11.2f')} {s.get('clients_failed', 0):>6} "
            f"{_fmt(s.get('wall_seconds'), '7.1f')}")
    return "\n".join(lines)
