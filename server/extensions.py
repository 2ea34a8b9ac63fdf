"""The server's one extension point: what a round's messages carry, which replies it takes, and
the columns it adds.

A :class:`RoundExtension` is asked at each step of a round, and every hook has a default that
changes nothing:

1. :meth:`~RoundExtension.message_keys`, as the round's train messages are built: config keys
   added to one client's message (the network emulator: its scenario and the round's start on
   its virtual clock);
2. :meth:`~RoundExtension.arrived`, when the replies are in: which of them reached the server
   (the emulator: a reply whose upload its link cut never did). Every extension is shown every
   reply; a reply one of them drops is neither checked nor counted;
3. :meth:`~RoundExtension.select`, once the arrived replies are checked
   (:mod:`server.replies`): which of them the round takes, and which clients hold the round's
   model although their reply is not taken (the emulator's clock: the first
   ``clients_per_round`` valid finishers within the deadline; the late ones trained on the model
   sent). One extension at most selects; without one a round takes every reply;
4. :meth:`~RoundExtension.after_round`, when the round is aggregated: the per-round columns it
   adds (``rounds.csv``, and, as its :class:`Column` says, a TensorBoard tag and a fragment of the
   progress line) and per-client columns (``clients.csv``); it may also correct the rows it is
   shown before anything is written (the emulator marks the clients its clock dropped);
5. at the end, keys of ``summary.json`` (:meth:`~RoundExtension.summary`); across a resume, the
   keys the run must keep (:meth:`~RoundExtension.run_config`) and its state in the checkpoint.

Besides, :meth:`~RoundExtension.step` is told as each of the server's steps of a round begins
and ends, on the thread that runs it (``configure``, ``aggregate``, ``evaluate``): the emulator
charges the server's measured work to its clock.

The strategy's steps stay its own and callable one by one (check the replies, aggregate the
checked ones: :meth:`server.strategy.DGCStrategy.check_replies`,
:meth:`~server.strategy.DGCStrategy.aggregate_checked`); an extension decides *which* replies a
step sees, never how the step runs, and keeps its own clock: the core names no time but the
wall clock. The model for the columns is pfl-research's
``TrainingProcessCallback.after_central_iteration``, which returns the metrics it adds: the
server never names them. The network emulator is the largest user
(:func:`simulations.netem.integration.extensions`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message

from server.records import ClientRow, RoundRecord
from server.replies import CheckedReply

__all__ = ["Added", "Column", "ExtensionError", "Reply", "RoundExtension", "Selection"]

#: A value a train message's ConfigRecord may carry.
ConfigValue = bool | int | float | str


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


@dataclass(frozen=True)
class Reply:
    """One reply of the round, as it came, with the server's key for its sender (-1: no client
    of this run; an error the SuperLink sent for a node is the client's it answers)."""

    message: Message
    client_key: int


@dataclass(frozen=True)
class Selection:
    """What a round takes of its checked replies.

    Attributes
    ----------
    taken : tuple of CheckedReply
        The replies the round counts, in the order it takes them: of the valid ones the first
        ``clients_per_round`` in sampling order are aggregated, the others are surplus; a
        sampled client without a reply here gets a row that says it timed out (which
        :meth:`RoundExtension.after_round` may correct).
    processed : frozenset of int
        Client keys that hold the round's model although their reply is not taken (a late
        reply trained on it): the next downlink may build on it.
    """

    taken: tuple[CheckedReply, ...]
    processed: frozenset[int] = frozenset()


class RoundExtension:
    """Hooks into every round (see the module docstring). Subclass and override what you need."""

    #: The per-round columns it adds, in order.
    columns: tuple[Column, ...] = ()

    def describe(self) -> str:
        """One line for the strategy's settings log ("" for none)."""
        return ""

    def set_model(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Told the global model's tensor shapes when the strategy adopts it (before the first
        round it runs, resumed or not)."""

    def step(self, server_round: int, name: str, begins: bool) -> None:
        """Told as step ``name`` of round ``server_round`` begins and ends, on the thread that
        runs it: ``configure`` (the train messages), ``aggregate`` (from the replies to the
        round's record, :meth:`after_round` included), ``evaluate`` (the central evaluation
        after the round; round 0: of the initial model)."""

    def message_keys(self, server_round: int, client_key: int) -> Mapping[str, ConfigValue]:
        """Config keys added to the train message of ``client_key`` in ``server_round``."""
        return {}

    def arrived(self, server_round: int, replies: Sequence[Reply]) -> Sequence[Reply]:
        """The ones of ``replies`` (every reply of the round) that reached the server."""
        return replies

    def select(self, server_round: int, checked: Sequence[CheckedReply]) -> Selection | None:
        """What the round takes of ``checked`` (the arrived replies, checked, in arrival
        order); None: the strategy's rule (every reply). One extension at most overrides it."""
        return None

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


class ExtensionError(ValueError):
    """The extensions given to a strategy cannot work together."""


def selector_of(extensions: Sequence[RoundExtension]) -> RoundExtension | None:
    """The one extension that selects a round's replies (None: none does); ExtensionError when
    two would."""
    selecting = [ext for ext in extensions if type(ext).select is not RoundExtension.select]
    if len(selecting) > 1:
        raise ExtensionError(f"at most one extension may select a round's replies, got "
                             f"{[type(ext).__name__ for ext in selecting]}")
    return selecting[0] if selecting else None


def arrived(extensions: Sequence[RoundExtension], server_round: int,
            replies: Sequence[Reply]) -> list[Reply]:
    """The replies every extension lets reach the server, in the order they came."""
    kept = {id(r) for r in replies}
    for ext in extensions:
        kept &= {id(r) for r in ext.arrived(server_round, replies)}
    return [r for r in replies if id(r) in kept]


def apply_extensions(extensions: Sequence[RoundExtension], record: RoundRecord,
                     rows: list[ClientRow]) -> None:
    """Run every extension on the finished round, keeping what each adds in ``record.extra``
    (an extension sees the columns of those before it) and the rows' ``extra``."""
    by_key = {row.client_key: row for row in rows}
    for ext in extensions:
        added = ext.after_round(record, rows)
        record.extra.update(added.round)
        for key, values in added.clients.items():
            by_key[key].extra.update(values)


def columns_of(extensions: Sequence[RoundExtension]) -> list[Column]:
    """Every column the extensions add, in order."""
    return [c for ext in extensions for c in ext.columns]
