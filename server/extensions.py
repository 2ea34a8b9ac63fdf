"""The server's one extension point: columns the core does not name, added after every round.

A :class:`RoundExtension` is told each finished round's record and client rows (before they are
kept) and returns the values it adds: per-round columns (``rounds.csv``, and, as its
:class:`Column` says, a TensorBoard tag and a fragment of the progress line) and per-client
columns (``clients.csv``); at the end it adds keys to ``summary.json``, and it may keep state in
the checkpoint. The network emulator's virtual time and drops come this way
(``simulations.netem.strategy``); so may wire bytes or energy. The model is pfl-research's
``TrainingProcessCallback.after_central_iteration``, which returns the metrics it adds: the
server never names them.

An extension may also correct the rows it is shown (the emulator marks the clients its clock
dropped, and the round's failure count with them): it sees them before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from server.records import ClientRow, RoundRecord

__all__ = ["Added", "Column", "RoundExtension"]


@dataclass(frozen=True)
class Column:
    """A per-round column an extension adds.

    Attributes
    ----------
    name : str
        The ``rounds.csv`` column (also the round's MetricRecord entry).
    tag : str
        Its TensorBoard tag (``group/name``), or "" for none.
    progress : str
        Its fragment of the progress line, a format given the round's value and the run's total
        so far (``"virtual s: round {0:.1f} total {1:.1f}"``; one field takes the round's), or
        "" for none.
    """

    name: str
    tag: str = ""
    progress: str = ""


@dataclass
class Added:
    """What an extension adds to one round: its columns' values, and per client key the values
    of its client columns."""

    round: dict[str, int | float] = field(default_factory=dict)
    clients: dict[int, dict[str, int | float | str]] = field(default_factory=dict)


class RoundExtension:
    """Adds columns to every round (see the module docstring). Subclass and override."""

    #: The per-round columns it adds, in order.
    columns: tuple[Column, ...] = ()

    def after_round(self, record: RoundRecord, rows: list[ClientRow]) -> Added:
        """The values this extension adds to the finished round ``record`` (accuracy and loss
        are not known yet) whose sampled clients' rows are ``rows``."""
        return Added()

    def summary(self, rounds: Sequence[RoundRecord]) -> dict[str, Any]:
        """Keys it adds to ``summary.json``, from every round of the run."""
        return {}

    def run_config(self) -> dict[str, Any]:
        """Keys a resumed run must keep (checked against the checkpoint's)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What it keeps across rounds, for the checkpoint."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""


def apply_extensions(extensions: Sequence[RoundExtension], record: RoundRecord,
                     rows: list[ClientRow]) -> None:
    """Run every extension on the finished round, keeping what each adds in ``record.extra``
    and the rows' ``extra``."""
    by_key = {row.client_key: row for row in rows}
    for ext in extensions:
        added = ext.after_round(record, rows)
        record.extra.update(added.round)
        for key, values in added.clients.items():
            by_key[key].extra.update(values)


def columns_of(extensions: Sequence[RoundExtension]) -> list[Column]:
    """Every column the extensions add, in order."""
    return [c for ext in extensions for c in ext.columns]
