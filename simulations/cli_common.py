"""What both command lines (``run``/``compare`` and ``deploy``) share: ``--config`` and
``--set`` parsing and the table of a run's headline numbers.

A module of its own so that ``simulations.cli`` and ``simulations.deploy.cli`` both import it
and neither imports the other's internals.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedgc.settings import SettingsError, load_toml
from simulations.netem.target import NOT_REACHED

__all__ = ["COLUMN_HELP", "columns_help", "load_config_file", "parse_sets", "seeds_table",
           "summary_table"]


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


#: A cell without a value: words, never ``nan`` (a run that never reached the target reads
#: "not reached", :data:`simulations.netem.target.NOT_REACHED`).
MISSING = "n/a"


def _fmt(x: Any, spec: str, missing: str = MISSING) -> str:
    return missing if x is None or (isinstance(x, float) and not math.isfinite(x)) \
        else format(x, spec)


# (header, summary key, format, scale). "x dense" is the ratio to dense FedAvg: the dense run of
# the same comparison where there is one (<dir>_vs_dense), else the run's own <dir>_compression
# (dense fp32 for the same messages); both are dense bytes over the method's.
# "uplink MB" and the like are fedgc's payload; "wire ..." what the links carried for it
# (runs under the network emulator, whose protocol model adds Flower's messages, HTTP, TLS and
# TCP/IP: simulations.netem.wire_columns), shown when a run has them, with joules.
_COLUMNS = (("final acc", "final_accuracy", ".4f", 1.0),
            ("last10 acc", "last10_accuracy", ".4f", 1.0),
            ("uplink MB", "uplink_bytes", ".3f", 1e-6), ("x dense", "uplink", ".1f", 1.0),
            ("downlink MB", "downlink_bytes", ".2f", 1e-6), ("x dense", "downlink", ".1f", 1.0),
            ("total MB", "total_bytes", ".2f", 1e-6), ("x dense", "total", ".1f", 1.0))
_WIRE_COLUMNS = (("wire up MB", "wire_uplink_bytes", ".3f", 1e-6),
                 ("x dense", "wire_uplink", ".1f", 1.0),
                 ("wire down MB", "wire_downlink_bytes", ".2f", 1e-6),
                 ("x dense", "wire_downlink", ".1f", 1.0),
                 ("wire total MB", "wire_total_bytes", ".2f", 1e-6),
                 ("x dense", "wire_total", ".1f", 1.0),
                 ("J/client-round", "joules_per_client_round", ".1f", 1.0))
#: Runs under the network emulator, beside the accuracy: their virtual seconds, and the
#: virtual seconds, wire MB and joules until they first reached the target accuracy
#: (simulations.netem.target; the line under compare's table names the target).
_TIME_COLUMNS = (("virtual s", "virtual_seconds", ".0f", 1.0),
                 ("s to target", "virtual_seconds_to_target", ".0f", 1.0),
                 ("wire MB to target", "wire_bytes_to_target", ".2f", 1e-6),
                 ("J to target", "joules_to_target", ".0f", 1.0))
#: The columns whose empty value means the run never reached the target.
_TO_TARGET = ("virtual_seconds_to_target", "wire_bytes_to_target", "joules_to_target")
#: A comparison's readings: the mean accuracy per decade of total bytes
#: (simulations.compare.traffic_area); the round and total MB at which the last-10 mean first
#: reaches dense's (simulations.compare.reach); the share of the byte range where a compressed
#: method's curve is at or above every other compressed method's (simulations.compare.curve_above).
_READINGS = (("acc/decade", "traffic_auc_mean", ".4f", 1.0),
             ("above others", "curve_above_share", ".2f", 1.0),
             ("rounds to dense", "reach_dense_round", ".0f", 1.0),
             ("MB to dense", "reach_dense_bytes", ".2f", 1e-6))


#: What every column of the tables of ``run``, ``compare`` and ``compare --seeds`` says, by
#: header (``compare --help`` prints it, docs/guide.md's "The compare table" holds it).
COLUMN_HELP = {
    "method": "the method's label (a method of your own: its label, not its module:callable)",
    "seeds": "with --seeds, the runs averaged, where methods differ",
    "final acc": "the global model's accuracy on the test split after the last round",
    "last10 acc": "the mean of that accuracy over the last 10 rounds",
    "virtual s": "with netem: the run's time on the emulator's clock (its rounds' virtual "
                 "seconds, each the clients' part and the server's)",
    "s to target": "with netem: virtual seconds until the model first reached the target "
                   "accuracy (netem.target_accuracy; 0: in a comparison, dense FedAvg's "
                   "last-10, said under the table); 'not reached', or 'n/a' without a target",
    "wire MB to target": "with netem: the bytes the links carried until then",
    "uplink MB": "payload the clients sent in all rounds (fedgc's wire format), in MB",
    "downlink MB": "payload the server sent (models, patches, round material), in MB",
    "total MB": "uplink + downlink payload",
    "x dense": "dense FedAvg's bytes over this method's, for the column on its left: the dense "
               "run of the same comparison (without one, dense float32 for the same messages)",
    "wire up MB": "with netem: bytes the emulated links carried up for that payload "
                  "(netem.protocol adds Flower's messages, HTTP, TLS, TCP/IP)",
    "wire down MB": "with netem: the same, down",
    "wire total MB": "with netem: up + down on the links",
    "J/client-round": "with netem: the joules (radio and processor) a client spent per round "
                      "it worked in",
    "J to target": "with netem: every client's joules, idle ones included, until then",
    "acc/decade": "accuracy averaged over the run's total bytes on a log axis: the area "
                  "under accuracy against log10(cumulative bytes), per decade, from the "
                  "comparison's smallest first round (higher: more accuracy per byte)",
    "above others": "the share of the byte range (log-spaced budgets) at which this "
                    "compressed method's last-10 accuracy is at or above every other "
                    "compressed method's",
    "rounds to dense": "the round after which its last-10 accuracy first reaches dense "
                       "FedAvg's final last-10 ('-': never)",
    "MB to dense": "the total MB it had sent by then",
    "failed": "sampled client-rounds without an update (timed out, errors; the emulator's "
              "drops)",
    "wall s": "the run's wall-clock seconds",
}


def columns_help(width: int = 100) -> str:
    """:data:`COLUMN_HELP` as an indented list for ``--help``."""
    out = ["the table's columns:"]
    for head, text in COLUMN_HELP.items():
        out += textwrap.wrap(f"{head}: {text}", width, initial_indent="  ",
                             subsequent_indent="      ")
    return "\n".join(out)


def _columns(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str, float]]:
    """The table's columns: the accuracy, then virtual time and what the run spent to the
    target where a run was emulated, the payload's, the wire's and joules where a run has
    them, each of the readings where one of the rows has it."""
    wire = any("wire_uplink_bytes" in r for r in rows)
    emulated = any("virtual_seconds" in r for r in rows)
    return [*_COLUMNS[:2], *(_TIME_COLUMNS if emulated else ()), *_COLUMNS[2:],
            *(_WIRE_COLUMNS if wire else ()),
            *(c for c in _READINGS if any(c[1] in r for r in rows))]


def _missing(s: Mapping[str, Any], key: str) -> str:
    """The words of an empty cell: "not reached" for a run that has a target but never
    reached it, else "n/a"."""
    if key in _TO_TARGET and s.get("target_accuracy"):
        return NOT_REACHED
    return MISSING


#: The columns of ratios to dense (:func:`_key`).
_RATIOS = ("uplink", "downlink", "total", "wire_uplink", "wire_downlink", "wire_total")


def _key(s: Mapping[str, Any], key: str) -> str:
    if key in _RATIOS:
        return f"{key}_vs_dense" if f"{key}_vs_dense" in s else f"{key}_compression"
    return key


def _scaled(x: Any, scale: float) -> Any:
    return x * scale if isinstance(x, (int, float)) and not isinstance(x, bool) else x


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                     for i, (h, w) in enumerate(zip(head, widths, strict=True)))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    return "\n".join(out)


def summary_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """A plain-text table of the headline numbers of one or more runs (method -> summary)."""
    columns = _columns(list(summaries.values()))
    head = ["method", *(c[0] for c in columns), "failed", "wall s"]
    rows = [[name, *(_fmt(_scaled(s.get(_key(s, key)), scale), spec, _missing(s, key))
                     for _, key, spec, scale in columns),
             str(s.get("clients_failed", 0)), _fmt(s.get("wall_seconds"), ".1f")]
            for name, s in summaries.items()]
    return _table(head, rows)


def seeds_table(doc: Mapping[str, Any]) -> str:
    """The table of ``compare --seeds``' aggregate ``compare.json``: mean +- std over seeds.

    The ratios to dense are given as their means (their spread is that of the bytes, given
    beside them); the runs per method only when they differ between methods (the line above
    the table names the seeds), so that a dozen methods fit a terminal's width.
    """
    columns = _columns([agg["mean"] for agg in doc["methods"].values()])
    runs = {agg["runs"] for agg in doc["methods"].values()}
    head = ["method", *(["seeds"] if len(runs) > 1 else []), *(c[0] for c in columns)]
    rows = []
    for name, agg in doc["methods"].items():
        mean, std = agg["mean"], agg["std"]
        reached = agg.get("reached", {})
        cells = []
        for _, key, spec, scale in columns:
            k = _key(mean, key)
            m = _fmt(_scaled(mean.get(k), scale), spec, _missing(mean, key))
            d = _fmt(_scaled(std.get(k), scale), spec)
            cell = m if d == MISSING or key in _RATIOS else f"{m} +- {d}"
            if key in reached and 0 < reached[key] < agg["runs"]:
                cell += f" ({reached[key]} of {agg['runs']})"  # the mean is over those
            cells.append(cell)
        rows.append([name, *([str(agg["runs"])] if len(runs) > 1 else []), *cells])
    return _table(head, rows)
