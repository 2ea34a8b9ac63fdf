"""Results files of a run: ``rounds.csv``, ``clients.csv`` and ``summary.json`` (the schema).

``rounds.csv`` has at least :data:`ROUND_COLUMNS`; ``summary.json`` at least
:data:`SUMMARY_KEYS`. Other tools (plots, compare, the network emulator) read these names.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from fedgc.files import atomic_write_text
from server.records import ClientRow, RoundRecord

ROUND_COLUMNS = ("round", "accuracy", "loss", "uplink_bytes", "downlink_bytes",
                 "clients_sampled", "clients_aggregated", "clients_failed", "wall_seconds")
SUMMARY_KEYS = ("method", "final_accuracy", "last10_accuracy", "rounds", "uplink_bytes",
                "downlink_bytes", "total_bytes", "dense_uplink_bytes", "uplink_compression",
                "total_compression", "wall_seconds")
#: Rounds at the end of a run whose mean accuracy is ``last10_accuracy``: one round's accuracy
#: moves by a point or more under label skew, the mean of ten is what a comparison can rank.
LAST_ROUNDS = 10


def _atomic_write(path: Path, text: str) -> None:
    atomic_write_text(path, text)


def _csv_text(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k, "") for k in columns})
    return buf.getvalue()


def _flat_rows(records: Sequence[RoundRecord | ClientRow]) -> tuple[list[str], list[dict]]:
    """(the columns, the rows) of records whose ``extra`` holds extensions' columns: their own
    fields first, then every extension column in the order first seen."""
    rows, extra = [], {}
    for r in records:
        row = asdict(r)
        more = row.pop("extra")
        extra.update(dict.fromkeys(more))
        rows.append({**row, **more})
    return list(extra), rows


def round_columns(extra: Sequence[str] = ()) -> list[str]:
    """Every column of ``rounds.csv``: the schema's first, the record's other fields, then the
    extensions' (``extra``)."""
    own = [f.name for f in fields(RoundRecord) if f.name not in ROUND_COLUMNS
           and f.name != "extra"]
    return list(ROUND_COLUMNS) + own + list(extra)


def write_rounds(run_dir: Path, rounds: Sequence[RoundRecord]) -> None:
    """(Re)write ``rounds.csv`` from all rounds so far (a resumed run keeps earlier rounds)."""
    extra, rows = _flat_rows(rounds)
    _atomic_write(run_dir / "rounds.csv", _csv_text(round_columns(extra), rows))


def write_clients(run_dir: Path, rows: Sequence[ClientRow]) -> None:
    """Write ``clients.csv``: one line per sampled client per round."""
    extra, flat = _flat_rows(rows)
    cols = [f.name for f in fields(ClientRow) if f.name != "extra"] + extra
    _atomic_write(run_dir / "clients.csv", _csv_text(cols, flat))


def last_mean(accuracies: Sequence[float], n: int = LAST_ROUNDS) -> float:
    """Mean of the finite values among the last ``n`` rounds' ``accuracies`` (NaN when none)."""
    tail = [a for a in accuracies[-n:] if math.isfinite(a)]
    return sum(tail) / len(tail) if tail else float("nan")


def traffic(up: int, down: int, dense_up: int, dense_down: int) -> dict[str, Any]:
    """Bytes both ways and in total, each with its compression against dense FedAvg.

    ``dense_*`` is what dense fp32 FedAvg would have sent for the same messages, so a
    compression of 3.0 means three times fewer bytes than dense FedAvg.
    """
    def ratio(dense: int, sent: int) -> float:
        return dense / sent if sent else float("nan")

    return {
        "uplink_bytes": up,
        "downlink_bytes": down,
        "total_bytes": up + down,
        "dense_uplink_bytes": dense_up,
        "dense_downlink_bytes": dense_down,
        "dense_total_bytes": dense_up + dense_down,
        "uplink_compression": ratio(dense_up, up),
        "downlink_compression": ratio(dense_down, down),
        "total_compression": ratio(dense_up + dense_down, up + down),
    }


def summarize(rounds: Sequence[RoundRecord], method: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The ``summary.json`` dict of a run's rounds."""
    last = rounds[-1] if rounds else RoundRecord(0)
    accs = [r.accuracy for r in rounds if math.isfinite(r.accuracy)]
    return {
        "method": method,
        "final_accuracy": last.accuracy if rounds else float("nan"),
        "last10_accuracy": last_mean([r.accuracy for r in rounds]),
        "final_loss": last.loss if rounds else float("nan"),
        "best_accuracy": max(accs) if accs else float("nan"),
        "rounds": len(rounds),
        **traffic(sum(r.uplink_bytes for r in rounds), sum(r.downlink_bytes for r in rounds),
                  sum(r.dense_uplink_bytes for r in rounds),
                  sum(r.dense_downlink_bytes for r in rounds)),
        "clients_aggregated": sum(r.clients_aggregated for r in rounds),
        "clients_failed": sum(r.clients_failed for r in rounds),
        "clients_rejected": sum(r.clients_rejected for r in rounds),
        "clients_surplus": sum(r.clients_surplus for r in rounds),
        "wall_seconds": sum(r.wall_seconds for r in rounds),
        **extra,
    }


def json_clean(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by None, so any JSON reader accepts it."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_clean(v) for v in obj]
    return obj


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as strict JSON (see :func:`json_clean`), atomically."""
    _atomic_write(path, json.dumps(json_clean(obj), indent=2, sort_keys=True) + "\n")


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Write ``summary.json``."""
    write_json(run_dir / "summary.json", summary)


def read_rounds(run_dir: Path) -> list[dict[str, float]]:
    """``rounds.csv`` as dicts of numbers (for plots and comparisons)."""
    with (Path(run_dir) / "rounds.csv").open() as fh:
        return [{k: float(v) if v not in ("", "nan") else float("nan") for k, v in row.items()}
                for row in csv.DictReader(fh)]
