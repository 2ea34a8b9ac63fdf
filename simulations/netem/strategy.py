"""NetemStrategy: DGCStrategy with the emulator's round clock (virtual time, deadline, drops).

Each round the strategy tells every sampled client the round's virtual start (``netem.*`` keys in
the train config); the :mod:`~simulations.netem.mod` on the client charges the exact encoded
bytes both ways and reports the client's timeline. ``aggregate_train`` then

1. validates every arrived reply (a rejected one is counted and does not count towards K);
2. closes the round with :class:`~simulations.netem.clock.RoundClock`: the first
   ``clients_per_round`` valid finishers within the deadline are aggregated;
3. hands only those (plus the in-time rejected ones, so they are counted) to DGCStrategy, which
   acknowledges the aggregated updates; every other client is not acknowledged and folds its
   update back into its residual at its next round (no gradient mass is lost);
4. records ``virtual_seconds``, ``dropped_deadline``, ``dropped_link`` and ``dropped_rejected``
   (:class:`NetemColumns`), and the payload and link bytes with their ratios to dense, joules
   and the round's time split (:class:`~simulations.netem.wire_columns.WireColumns`), through
   the server's extension point (:mod:`server.extensions`); the stragglers that came in time
   but after the K-th are over-selection's surplus (``clients_surplus``), not drops; and
   advances the virtual clock to the round's close.

The server's own time in a round (the profile's ``server`` part, :mod:`simulations.netem.protocol`)
is its work in the round's path as this run measures it: the CPU seconds of the server's thread
(``time.thread_time``: neither the machine's load nor a simulation engine's other threads count)
in ``configure_train`` (sampling, the downlink's patches) and in ``aggregate_train`` (decoding,
checks, aggregation, the server step and the broadcast's compression) up to the round's
record, plus, with ``netem.server_eval``, the previous round's central evaluation (it delays
this round), plus the profile's fixed ``server_s``. A round's ``virtual_seconds`` is its
clients' part (from its start to its close) plus that server time. The links' processes
(outages, traces) run on a clock without the measured part: it varies from run to run with the
machine, and a link clock that does not see it keeps a run's drops, bytes and accuracy
reproducible from its seeds (the on/off chains are stationary, so leaving the server's seconds
out of their time changes none of their statistics).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.supercore import log

from fedgc import protocol as P
from server.extensions import Added, Column, RoundExtension
from server.records import ClientRow, RoundRecord
from server.replies import CheckedReply
from server.strategy import DGCStrategy
from simulations.netem.clock import REASON_STRAGGLER, ClientTimeline, RoundClock, RoundOutcome
from simulations.netem.mod import timeline_from_reply
from simulations.netem.settings import (
    PREFIX,
    ROUND_KEY,
    ROUND_START_KEY,
    NetemSettings,
    profile_line,
)
from simulations.netem.target import reach_target
from simulations.netem.wire_columns import WireColumns


class NetemColumns(RoundExtension):
    """The emulator's columns: each round's virtual time and the clients its clock dropped, by
    cause (``rounds.csv``, TensorBoard, the progress line, ``summary.json``)."""

    # The progress line shows the round's virtual seconds and the run's so far: the report's
    # axis and its "virtual s total".
    columns = (Column("virtual_seconds", "time/virtual_seconds",
                      "virtual s: round {0:.1f} total {1:.1f}"),
               Column("dropped_deadline", "clients/dropped_deadline"),
               Column("dropped_link", "clients/dropped_link"),
               Column("dropped_rejected", "clients/dropped_rejected"))

    def __init__(self, strategy: NetemStrategy) -> None:
        self.strategy = strategy

    def after_round(self, record: RoundRecord, rows: list[ClientRow]) -> Added:
        """Mark the clients the clock dropped, and add the round's virtual time and drops.

        A straggler (in time, but after the K-th arrival closed the round) is over-selection
        doing its job: its row reads ``surplus`` (reason ``straggler``) and it is not counted
        as failed. Every other drop is a failure: ``dropped`` with its cause.
        """
        outcome = self.strategy.outcomes[record.round]
        server_s = self.strategy.round_server_s(record.round)
        rejected = self.strategy.rejected_finish
        for row in rows:
            why = outcome.dropped.get(row.client_key)
            late = rejected.get(row.client_key, -math.inf) > outcome.end_s
            if why == REASON_STRAGGLER:
                if row.status == "timeout":  # the base strategy saw no reply from it
                    record.clients_failed -= 1
                row.status, row.reason = "surplus", why
            elif why is not None:
                row.status, row.reason = "dropped", why
            elif late:
                row.status, row.reason = "dropped", "deadline"
        record.clients_surplus = sum(row.status == "surplus" for row in rows)
        return Added({
            "virtual_seconds": outcome.virtual_seconds + server_s,
            "dropped_deadline": outcome.dropped_deadline + sum(
                t > outcome.end_s for t in rejected.values()),
            "dropped_link": outcome.dropped_link,
            "dropped_rejected": sum(t <= outcome.end_s for t in rejected.values())})

    def summary(self, rounds: Any) -> dict[str, Any]:
        """The emulator's keys of ``summary.json``."""
        def total(name: str) -> float:
            return sum(r.extra.get(name, 0) for r in rounds)

        target = self.strategy.target_accuracy
        reached = reach_target([{"accuracy": r.accuracy, **r.extra} for r in rounds],
                               target) if target > 0 else None
        return {"virtual_seconds": total("virtual_seconds"),
                "target_accuracy": target or None,
                "virtual_seconds_to_target": reached.virtual_s if reached else None,
                "round_to_target": reached.row if reached else None,
                "wire_bytes_to_target": reached.wire_bytes if reached else None,
                "joules_to_target": reached.joules if reached else None,
                "server_seconds": total("round_server_s"),
                "dropped_deadline": total("dropped_deadline"),
                "dropped_link": total("dropped_link"),
                "dropped_rejected": total("dropped_rejected"),
                "netem": self.strategy.netem.to_config()}

    def run_config(self) -> dict[str, Any]:
        """The scenario: part of what a resumed run must keep (the target accuracy only
        reports)."""
        return {k: v for k, v in self.strategy.netem.to_config().items()
                if k != PREFIX + "target_accuracy"}


class NetemStrategy(DGCStrategy):
    """DGCStrategy whose rounds run on the network emulator's virtual clock.

    Parameters
    ----------
    netem : NetemSettings
        The scenario (links, devices, deadline); sent to every client with each train message.
    target_accuracy : float (default: 0.0)
        When > 0, the summary reports the virtual seconds, wire bytes and joules until the
        global model first reached it (:mod:`simulations.netem.target`).
    *args, **kwargs
        What :class:`server.strategy.DGCStrategy` takes (``settings``, ``method``,
        ``on_round``, ``extensions``).
    """

    def __init__(self, *args: Any, netem: NetemSettings, target_accuracy: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wire = WireColumns(self)
        self.extensions += [NetemColumns(self), self.wire]
        if not isinstance(netem, NetemSettings):
            raise TypeError(f"netem must be NetemSettings, got {type(netem).__name__}")
        if not (isinstance(target_accuracy, (int, float)) and 0.0 <= target_accuracy <= 1.0):
            raise ValueError(f"target_accuracy must be in [0, 1], got {target_accuracy!r}")
        self.netem = netem
        self.target_accuracy = float(target_accuracy)
        self.clock = RoundClock(self.clients_per_round, netem.deadline, self.over_selection)
        self.profile = netem.protocol_model()
        # The links' clock: the clients' part of every round and the profile's fixed server
        # seconds, never the measured ones (module docstring).
        self.virtual_now_s = 0.0
        # The server's work measured this round so far (CPU seconds), and each finished
        # round's server seconds as charged.
        self._work_s = 0.0
        self._work_started: float | None = None
        self._eval_s = 0.0
        self.server_seconds: dict[int, float] = {}
        self.outcomes: dict[int, RoundOutcome] = {}
        # This round's replies that failed validation: client key -> when they finished.
        self.rejected_finish: dict[int, float] = {}

    @property
    def server_s(self) -> float:
        """The profile's fixed server seconds per round (0 without a profile)."""
        return self.profile.server_s if self.profile is not None else 0.0

    def round_server_s(self, server_round: int) -> float:
        """Round ``server_round``'s server seconds: the profile's fixed ones, plus (with
        ``server_measured``) the work measured from its ``configure_train`` to now, inside its
        ``aggregate_train`` (module docstring). The first call of a round fixes the value."""
        if server_round not in self.server_seconds:
            work = self._work_s
            if self._work_started is not None:
                work += time.thread_time() - self._work_started
            measured = self.profile is not None and self.profile.server_measured
            self.server_seconds[server_round] = self.server_s + (work if measured else 0.0)
            for old in [r for r in self.server_seconds if r < server_round - 1]:
                del self.server_seconds[old]
        return self.server_seconds[server_round]

    def summary(self) -> None:
        """Log summary configuration of the strategy."""
        n = self.netem
        log(INFO, "\t├──> Network emulator: mix %s, %.0f%% intermittent (%s), deadline %s",
            n.mix, 100 * n.intermittent, n.outage_policy,
            f"{n.deadline_s:g} s" if n.deadline_s > 0 else "none")
        log(INFO, "\t├──> Protocol profile: %s", profile_line(n))
        super().summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """DGCStrategy's messages, each told the scenario and the round's virtual start."""
        started = time.thread_time()
        messages = list(super().configure_train(server_round, arrays, config, grid))
        # The previous round's evaluation (with netem.server_eval) delayed this one.
        self._work_s, self._eval_s = time.thread_time() - started + self._eval_s, 0.0
        keys = {**self.netem.to_config(), ROUND_KEY: server_round,
                ROUND_START_KEY: float(self.virtual_now_s)}
        for msg in messages:
            cfg = msg.content.config_records[P.CONFIG]
            for k, v in keys.items():
                cfg[k] = v
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Close the round on the virtual clock, then aggregate the first K valid finishers."""
        self._work_started = time.thread_time()
        start_s = self.virtual_now_s
        arrived: list[tuple[Message, ClientTimeline]] = []
        others: list[Message] = []  # errors and replies without a timeline: DGCStrategy decides
        computed: set[int] = set()
        for msg in replies:
            tl = timeline_from_reply(msg)
            if tl is None:
                others.append(msg)
                continue
            # The strategy's own key for the node, so that clock, rows and acks agree.
            key = self.registry.node_keys.get(msg.metadata.src_node_id, tl.client_id)
            arrived.append((msg, dataclasses.replace(tl, client_id=key)))
            if P.UPDATE in msg.content.array_records:
                computed.add(key)
        # Checked once, together (one decode pass); what is forwarded is not checked again.
        finished = [m for m, tl in arrived if tl.ok]
        checked = self.check_replies(server_round, finished + others)
        checks = iter(checked[:len(finished)])  # in the order of ``finished``
        valid: dict[int, CheckedReply] = {}
        rejected: dict[int, tuple[CheckedReply, float]] = {}
        timelines, ignored = [], []
        for _, tl in arrived:
            if tl.ok:
                c = next(checks)
                if c.status == "ignored":  # not sampled, or a second reply: counted, no more
                    ignored.append(c)
                    continue
                if c.status != "valid":
                    rejected[tl.client_id] = (c, tl.finish_s)
                    continue
                valid[tl.client_id] = c
            timelines.append(tl)
        outcome = self.clock.close(server_round, start_s, timelines)
        self.wire.take(server_round, [(tl.client_id, m) for m, tl in arrived],
                       outcome.virtual_seconds)
        in_time_rejected = [c for c, t in rejected.values() if t <= outcome.end_s]
        self.outcomes[server_round] = outcome
        self.rejected_finish = {k: t for k, (_, t) in rejected.items()}
        # A client that replied with an update (even too late, or cut on the uplink) trained on
        # the model sent this round, so it holds that version: the download completed, which
        # the server's side of the transfer knows. Later patches may build on it.
        forwarded = ([valid[k] for k in outcome.aggregated] + in_time_rejected
                     + checked[len(finished):] + ignored)
        arrays, metrics = self.aggregate_checked(server_round, forwarded, processed=computed)
        self._work_started = None
        self.virtual_now_s = outcome.end_s + self.server_s
        added = self.round_record.extra
        log(INFO, "netem: round %d took %.1f virtual s; dropped %d deadline, %d link, %d "
            "rejected; %d surplus", server_round, outcome.virtual_seconds,
            added["dropped_deadline"], added["dropped_link"], added["dropped_rejected"],
            self.round_record.clients_surplus)
        return arrays, metrics

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
              ) -> Result:
        """DGCStrategy's loop; with ``netem.server_eval`` (and the server's work measured) the
        central evaluation is timed and charged to the next round (module docstring)."""
        charged = (evaluate_fn is not None and self.netem.server_eval
                   and self.profile is not None and self.profile.server_measured)
        if charged:
            evaluate = evaluate_fn

            def timed(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
                started = time.thread_time()
                try:
                    return evaluate(server_round, arrays)
                finally:
                    self._eval_s += time.thread_time() - started

            evaluate_fn = timed
        return super().start(grid, initial_arrays, num_rounds, timeout, train_config,
                             evaluate_config, evaluate_fn)

    def state_dict(self) -> dict[str, Any]:
        """DGCStrategy's state plus the virtual clock."""
        return {**super().state_dict(), "virtual_now_s": self.virtual_now_s}

    def load_state_dict(self, state: Any) -> None:
        """Continue from :meth:`state_dict`, virtual clock included."""
        super().load_state_dict(state)
        self.virtual_now_s = float(state.get("virtual_now_s", 0.0))

