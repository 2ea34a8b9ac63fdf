"""The emulator at the server: each round on the virtual clock (virtual time, deadline, drops),
plugged in through the server's extension point (:mod:`server.extensions`).

:class:`NetemClock` tells every sampled client the scenario and the round's virtual start
(``netem.*`` keys in its train message); the :mod:`~simulations.netem.mod` on the client charges
the exact encoded bytes both ways and reports the client's timeline. When the replies are in,

1. a reply whose timeline failed (its link went down, its device was away) never reached the
   server: it is not checked (:meth:`NetemClock.arrived`);
2. the arrived replies are checked by the strategy; a rejected one does not count towards K;
3. :class:`~simulations.netem.clock.RoundClock` closes the round (:meth:`NetemClock.select`): the
   first ``clients_per_round`` valid finishers within the deadline are taken (plus the in-time
   rejected ones, so they are counted); every other client is not acknowledged and folds its
   update back into its residual at its next round (no gradient mass is lost);
4. the round's ``virtual_seconds``, ``dropped_deadline``, ``dropped_link`` and
   ``dropped_rejected`` are its columns; the stragglers that came in time but after the K-th are
   over-selection's surplus (``clients_surplus``), not drops. The virtual clock moves to the
   round's close.

The server's own time in a round (the profile's ``server`` part, :mod:`simulations.netem.protocol`)
is its work in the round's path as this run measures it: the CPU seconds of the server's thread
(``time.thread_time``: neither the machine's load nor a simulation engine's other threads count)
in its ``configure`` step (sampling, the downlink's patches) and in its ``aggregate`` step
(decoding, checks, aggregation, the server step and the broadcast's compression) up to the
round's record, plus, with ``netem.server_eval``, the previous round's central evaluation (it
delays this round), plus the profile's fixed ``server_s``; the strategy says when each step
begins and ends (:meth:`NetemClock.step`). A round's ``virtual_seconds`` is its clients' part
(from its start to its close) plus that server time. The links' processes (outages, traces) run
on a clock without the measured part: it varies from run to run with the machine, and a link
clock that does not see it keeps a run's drops, bytes and accuracy reproducible from its seeds
(the on/off chains are stationary, so leaving the server's seconds out of their time changes
none of their statistics).

The payload and link bytes with their ratios to dense, joules and the round's time split are
:class:`~simulations.netem.wire_columns.WireColumns`, the emulator's second extension.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Collection, Mapping, Sequence
from logging import INFO
from typing import Any

from flwr.supercore import log

from fedgc import protocol as P
from server.extensions import (
    Added,
    Arrival,
    Column,
    ConfigValue,
    Reply,
    RoundExtension,
    Selection,
)
from server.records import ClientRow, RoundRecord
from server.replies import CheckedReply
from simulations.netem.clock import REASON_STRAGGLER, ClientTimeline, RoundClock, RoundOutcome
from simulations.netem.mod import timeline_from_reply
from simulations.netem.settings import (
    PREFIX,
    ROUND_KEY,
    ROUND_START_KEY,
    NetemSettings,
    profile_line,
)
from simulations.netem.stages import stage_exchange
from simulations.netem.target import reach_target

__all__ = ["NetemClock"]


@dataclasses.dataclass
class _Arrivals:
    """One round's replies on the virtual clock, from :meth:`NetemClock.arrived` to
    :meth:`NetemClock.select`."""

    start_s: float
    timelines: dict[int, ClientTimeline]  # id(message) -> its timeline, keyed by client
    processed: frozenset[int]  # clients that trained on the round's model (an update came)


class NetemClock(RoundExtension):
    """The emulator's rounds on its virtual clock (module docstring): the keys each train
    message carries, which replies arrive and which the round takes, and the columns of each
    round's virtual time and of the clients its clock dropped, by cause (``rounds.csv``,
    TensorBoard, the progress line, ``summary.json``).

    Parameters
    ----------
    netem : NetemSettings
        The scenario (links, devices, deadline); sent to every client with each train message.
        ``netem.target_accuracy`` > 0: the summary reports the virtual seconds, wire bytes and
        joules until the global model first reached it (:mod:`simulations.netem.target`).
    clients_per_round : int
        K, the updates a round waits for.
    over_selection : float
        Clients sampled per wanted update (the strategy samples them).
    """

    # The progress line shows the round's virtual seconds and the run's so far: the report's
    # axis and its "virtual s total".
    columns = (Column("virtual_seconds", "time/virtual_seconds",
                      "virtual s: round {0:.1f} total {1:.1f}"),
               Column("dropped_deadline", "clients/dropped_deadline"),
               Column("dropped_link", "clients/dropped_link"),
               Column("dropped_rejected", "clients/dropped_rejected"))

    def __init__(self, netem: NetemSettings, clients_per_round: int,
                 over_selection: float = 1.0) -> None:
        if not isinstance(netem, NetemSettings):
            raise TypeError(f"netem must be NetemSettings, got {type(netem).__name__}")
        self.netem = netem
        self.clock = RoundClock(clients_per_round, netem.deadline, over_selection)
        self.profile = netem.protocol_model()
        # The links' clock: the clients' part of every round and the profile's fixed server
        # seconds, never the measured ones (module docstring).
        self.virtual_now_s = 0.0
        # The server's work measured this round so far (CPU seconds), and each finished
        # round's server seconds as charged.
        self._measured = self.profile is not None and self.profile.server_measured
        self._work_s = self._eval_s = 0.0
        self._started: dict[str, float | None] = {}
        self.server_seconds: dict[int, float] = {}
        self._keys = netem.to_config()
        self._arrivals: _Arrivals | None = None
        self._outcome: RoundOutcome | None = None
        # This round's replies that failed validation: client key -> when they finished.
        self._rejected_finish: dict[int, float] = {}
        # This round's extra exchanges (secure aggregation's stages): the virtual seconds
        # before the train messages and after the round's close, and per client key its wire
        # (up, down) bytes and radio joules, which WireColumns adds to the round's.
        self._before_s = self._after_s = 0.0
        self.exchange_bytes: dict[int, list[float]] = {}

    @property
    def server_s(self) -> float:
        """The profile's fixed server seconds per round (0 without a profile)."""
        return self.profile.server_s if self.profile is not None else 0.0

    def round_server_s(self, server_round: int) -> float:
        """Round ``server_round``'s server seconds: the profile's fixed ones, plus (with
        ``server_measured``) the work measured from its ``configure`` step to now, inside its
        ``aggregate`` step (module docstring). The first call of a round fixes the value."""
        if server_round not in self.server_seconds:
            work = self._work_s
            started = self._started.get("aggregate")
            if started is not None:
                work += time.thread_time() - started
            self.server_seconds[server_round] = self.server_s + (work if self._measured else 0.0)
            for old in [r for r in self.server_seconds if r < server_round - 1]:
                del self.server_seconds[old]
        return self.server_seconds[server_round]

    def describe(self) -> str:
        """The scenario and the protocol profile in one line."""
        n = self.netem
        deadline = f"{n.deadline_s:g} s" if n.deadline_s > 0 else "none"
        return (f"Network emulator: mix {n.mix}, {100 * n.intermittent:.0f}% intermittent "
                f"({n.outage_policy}), deadline {deadline}, devices {n.device_mix} x "
                f"{n.compute_factor:.2f} compute; protocol profile {profile_line(n)}")

    def step(self, server_round: int, name: str, begins: bool) -> None:
        """Time the server's work: its ``configure`` and ``aggregate`` steps, and with
        ``netem.server_eval`` its central evaluation, charged to the next round (module
        docstring)."""
        now = time.thread_time()
        if begins:
            self._started[name] = now
            if name == "configure":
                self._before_s = self._after_s = 0.0
                self.exchange_bytes = {}
            return
        started = self._started.pop(name, None)
        if started is None:
            return
        if name == "configure":
            # The previous round's evaluation (with netem.server_eval) delayed this one.
            self._work_s, self._eval_s = now - started + self._eval_s, 0.0
        elif name == "evaluate" and self.netem.server_eval:
            self._eval_s += now - started

    # ---- the round -----------------------------------------------------------------------
    def message_keys(self, server_round: int, client_key: int) -> Mapping[str, ConfigValue]:
        """The scenario and the round's virtual start."""
        return {**self._keys, ROUND_KEY: server_round,
                ROUND_START_KEY: float(self.virtual_now_s + self._before_s)}

    def exchanged(self, server_round: int, stage: str,
                  sizes: Mapping[int, tuple[int, int]]) -> Collection[int]:
        """Charge an extra exchange (secure aggregation's stages) to each client's link
        (:func:`simulations.netem.stages.stage_exchange`): before the train messages from the
        round's start, after the round's close from its end; the stage lasts until its last
        reply that arrived. The clients whose reply arrived."""
        after = self._outcome is not None and self._outcome.round_index == server_round
        start = (self._outcome.end_s + self._after_s if after and self._outcome is not None
                 else self.virtual_now_s + self._before_s)
        came, end = set(), start
        for key, (down, up) in sizes.items():
            ex = stage_exchange(self.netem, self.profile, key, server_round, start, down, up)
            wire = self.exchange_bytes.setdefault(key, [0, 0, 0.0])
            wire[0] += ex.wire_up_bytes
            wire[1] += ex.wire_down_bytes
            wire[2] += ex.radio_j
            if ex.ok:
                came.add(key)
                end = max(end, ex.finish_s)
        if after:
            self._after_s += end - start
        else:
            self._before_s += end - start
        return came

    def arrived(self, server_round: int, replies: Sequence[Reply]) -> Sequence[Reply]:
        """The replies whose timeline finished, and those without one (errors: the strategy
        decides); every timeline is kept for :meth:`select`."""
        timelines: dict[int, ClientTimeline] = {}
        processed: set[int] = set()
        kept = []
        for reply in replies:
            tl = timeline_from_reply(reply.message)
            if tl is not None:
                # The strategy's key for the sender, so that clock, rows and acks agree.
                timelines[id(reply.message)] = dataclasses.replace(tl, client_id=reply.client_key)
                records = reply.message.content.array_records
                if (P.UPDATE in records or P.SECAGG in records) and reply.client_key >= 0:
                    processed.add(reply.client_key)
            if tl is None or tl.ok:
                kept.append(reply)
        self._arrivals = _Arrivals(self.virtual_now_s, timelines, frozenset(processed))
        return kept

    def select(self, server_round: int, checked: Sequence[CheckedReply]) -> Selection:
        """Close the round on the virtual clock: the first K valid finishers within the
        deadline, the in-time rejected ones (counted), and the replies without a timeline."""
        arrivals = self._arrivals
        assert arrivals is not None, "select without arrived"
        valid: dict[int, CheckedReply] = {}
        rejected: dict[int, tuple[CheckedReply, float]] = {}
        others, ignored = [], []
        finished = {}
        for c in checked:
            tl = arrivals.timelines.get(id(c.message))
            if tl is None:
                others.append(c)
            elif c.status == "ignored":  # not sampled, or a second reply: counted, no more
                ignored.append(c)
            elif c.status != "valid":
                rejected[tl.client_id] = (c, tl.finish_s)
            else:
                valid[tl.client_id] = c
                finished[id(c.message)] = True
        # The clock sees the valid finishers and every failed timeline, in arrival order.
        timelines = [tl for i, tl in arrivals.timelines.items() if not tl.ok or i in finished]
        outcome = self.clock.close(server_round, arrivals.start_s, timelines)
        self._outcome = outcome
        self._rejected_finish = {k: t for k, (_, t) in rejected.items()}
        in_time_rejected = [c for c, t in rejected.values() if t <= outcome.end_s]
        # The links' clock: the clients' part and the profile's fixed server seconds.
        self.virtual_now_s = outcome.end_s + self.server_s
        # A client that replied with an update (even too late, or cut on the uplink) trained on
        # the model sent this round, so it holds that version: the download completed, which
        # the server's side of the transfer knows. Later patches may build on it.
        return Selection((*(valid[k] for k in outcome.aggregated), *in_time_rejected,
                          *others, *ignored), arrivals.processed)

    def after_round(self, record: RoundRecord, rows: list[ClientRow]) -> Added:
        """Mark the clients the clock dropped, and add the round's virtual time and drops.

        A straggler (in time, but after the K-th arrival closed the round) is over-selection
        doing its job: its row reads ``surplus`` (reason ``straggler``) and it is not counted
        as failed. Every other drop is a failure: ``dropped`` with its cause.
        """
        outcome = self._outcome
        assert outcome is not None and outcome.round_index == record.round
        server_s = self.round_server_s(record.round)
        rejected = self._rejected_finish
        for row in rows:
            why = outcome.dropped.get(row.client_key)
            late = rejected.get(row.client_key, -math.inf) > outcome.end_s
            if why == REASON_STRAGGLER:
                if row.status == "timeout":  # the strategy saw no reply from it
                    record.clients_failed -= 1
                row.status, row.reason = "surplus", why
            elif why is not None:
                row.status, row.reason = "dropped", why
            elif late:
                row.status, row.reason = "dropped", "deadline"
        record.clients_surplus = sum(row.status == "surplus" for row in rows)
        # The unmasking after the round's close moves the links' clock too.
        self.virtual_now_s += self._after_s
        added = {
            "virtual_seconds": outcome.virtual_seconds + self._after_s + server_s,
            "dropped_deadline": outcome.dropped_deadline + sum(
                t > outcome.end_s for t in rejected.values()),
            "dropped_link": outcome.dropped_link,
            "dropped_rejected": sum(t <= outcome.end_s for t in rejected.values())}
        if self.exchange_bytes:
            added["exchange_s"] = self._before_s + self._after_s
        log(INFO, "netem: round %d took %.1f virtual s; dropped %d deadline, %d link, %d "
            "rejected; %d surplus", record.round, outcome.virtual_seconds,
            added["dropped_deadline"], added["dropped_link"], added["dropped_rejected"],
            record.clients_surplus)
        return Added(added)

    # ---- mode = async ----------------------------------------------------------------------
    # The asynchronous loop (server.async_loop) orders replies by their timelines' finish on
    # this clock; each client's timeline starts when its message leaves. There is no round
    # deadline (async.max_staleness bounds old replies instead), and the server's work is not
    # charged: it aggregates while the other clients train.
    clocked = True

    def dispatch_at(self, now_s: float) -> None:
        """The next train messages leave at ``now_s`` (their ``netem.round_start``)."""
        self.virtual_now_s = float(now_s)

    def arrival(self, reply: Reply) -> Arrival | None:
        """When the reply's upload finished, or where its timeline failed (link down, device
        away); None for a reply without a timeline (an error: it arrives as sent)."""
        tl = timeline_from_reply(reply.message)
        if tl is None:
            return None
        return Arrival(tl.finish_s, tl.ok, "" if tl.ok else tl.reason)

    def after_step(self, record: RoundRecord, rows: list[ClientRow],
                   replies: Sequence[Reply], elapsed_s: float) -> Added:
        """The step's virtual seconds (since the last step) and its drops: ``dropped_link``
        counts the dispatches whose timeline failed, ``dropped_rejected`` the refused replies
        (stale ones included)."""
        self.server_seconds[record.round] = 0.0  # not charged (see above)
        return Added({"virtual_seconds": elapsed_s, "dropped_deadline": 0,
                      "dropped_link": sum(row.status == "dropped" for row in rows),
                      "dropped_rejected": sum(row.status == "rejected" for row in rows)})

    # ---- the run ---------------------------------------------------------------------------
    def summary(self, rounds: Sequence[RoundRecord]) -> dict[str, Any]:
        """The emulator's keys of ``summary.json``."""
        def total(name: str) -> float:
            return sum(r.extra.get(name, 0) for r in rounds)

        target = self.netem.target_accuracy
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
                "netem": self.netem.to_config()}

    def run_config(self) -> dict[str, Any]:
        """The scenario: part of what a resumed run must keep (the target accuracy only
        reports)."""
        return {k: v for k, v in self._keys.items() if k != PREFIX + "target_accuracy"}

    def state_dict(self) -> dict[str, Any]:
        """The virtual clock."""
        return {"virtual_now_s": self.virtual_now_s}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""
        self.virtual_now_s = float(state.get("virtual_now_s", 0.0))
