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
   and advances the virtual clock to the round's close.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from fedgc import protocol as P
from server.records import ClientRow, RoundRecord
from server.replies import CheckedReply
from server.strategy import DGCStrategy
from simulations.netem.clock import REASON_STRAGGLER, ClientTimeline, RoundClock, RoundOutcome
from simulations.netem.energy import LINK_RADIO, RadioPowerModel, Transfer, radio_energy
from simulations.netem.mod import reply_metrics, timeline_from_reply
from simulations.netem.protocol import ProtocolModel
from simulations.netem.settings import (
    ROUND_KEY,
    ROUND_START_KEY,
    NetemSettings,
    parse_fractions,
)


class NetemStrategy(DGCStrategy):
    """DGCStrategy whose rounds run on the network emulator's virtual clock.

    Parameters
    ----------
    netem : NetemSettings
        The scenario (links, devices, deadline); sent to every client with each train message.
    target_accuracy : float (default: 0.0)
        When > 0, the summary reports the virtual seconds until the global model first reached
        it (``virtual_seconds_to_target``).
    **kwargs
        Everything :class:`server.strategy.DGCStrategy` takes (``clients_per_round``,
        ``over_selection``, ...).
    """

    def __init__(self, *args: Any, netem: NetemSettings, target_accuracy: float = 0.0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(netem, NetemSettings):
            raise TypeError(f"netem must be NetemSettings, got {type(netem).__name__}")
        if not (isinstance(target_accuracy, (int, float)) and 0.0 <= target_accuracy <= 1.0):
            raise ValueError(f"target_accuracy must be in [0, 1], got {target_accuracy!r}")
        self.netem = netem
        self.target_accuracy = float(target_accuracy)
        self.clock = RoundClock(self.clients_per_round, netem.deadline, self.over_selection)
        self.virtual_now_s = 0.0
        self.outcomes: dict[int, RoundOutcome] = {}
        #: Per round: the protocol's and the radio's totals over the clients that worked
        #: (:data:`WIRE_KEYS`), and the idle nodes' bytes and joules.
        self.wire_rounds: dict[int, dict[str, float]] = {}
        # This round's replies that failed validation: client key -> when they finished.
        self._rejected_finish: dict[int, float] = {}

    def summary(self) -> None:
        """Log summary configuration of the strategy."""
        n = self.netem
        log(INFO, "\t├──> Network emulator: mix %s, %.0f%% intermittent (%s), deadline %s",
            n.mix, 100 * n.intermittent, n.outage_policy,
            f"{n.deadline_s:g} s" if n.deadline_s > 0 else "none")
        super().summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """DGCStrategy's messages, each told the scenario and the round's virtual start."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
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
        proto = self.netem.protocol_model()
        server_s = proto.server_s if proto is not None else 0.0
        self.wire_rounds[server_round] = self._wire_round(
            [m for m, _ in arrived], outcome.virtual_seconds + server_s)
        in_time_rejected = [c for c, t in rejected.values() if t <= outcome.end_s]
        self.outcomes[server_round] = outcome
        self._rejected_finish = {k: t for k, (_, t) in rejected.items()}
        # A client that replied with an update (even too late, or cut on the uplink) trained on
        # the model sent this round, so it holds that version: the download completed, which
        # the server's side of the transfer knows. Later patches may build on it.
        forwarded = ([valid[k] for k in outcome.aggregated] + in_time_rejected
                     + checked[len(finished):] + ignored)
        arrays, metrics = self.aggregate_checked(server_round, forwarded, processed=computed)
        # The server's own work between rounds (aggregation, evaluation, scheduling), as the
        # protocol's calibration measured it.
        self.virtual_now_s = outcome.end_s + server_s
        if metrics is not None:
            metrics["virtual_seconds"] = outcome.virtual_seconds + server_s
        record = self.round_record
        log(INFO, "netem: round %d took %.1f virtual s; dropped %d deadline, %d link, %d "
            "rejected", server_round, outcome.virtual_seconds, record.dropped_deadline,
            record.dropped_link, record.dropped_rejected)
        return arrays, metrics

    def close_round(self, record: RoundRecord, rows: list[ClientRow]) -> None:
        """Mark the clients the clock dropped, and record the round's virtual time.

        A straggler (in time, but after the K-th arrival closed the round) is over-selection
        doing its job: its row reads ``surplus`` (reason ``straggler``) and it is not counted
        as failed. Every other drop is a failure: ``dropped`` with its cause.
        """
        outcome = self.outcomes[record.round]
        for row in rows:
            why = outcome.dropped.get(row.client_key)
            late = self._rejected_finish.get(row.client_key, -math.inf) > outcome.end_s
            if why == REASON_STRAGGLER:
                if row.status == "timeout":  # the base strategy saw no reply from it
                    record.clients_failed -= 1
                row.status, row.reason = "surplus", why
            elif why is not None:
                row.status, row.reason = "dropped", why
            elif late:
                row.status, row.reason = "dropped", "deadline"
        proto = self.netem.protocol_model()
        record.virtual_seconds = outcome.virtual_seconds + (
            proto.server_s if proto is not None else 0.0)
        record.dropped_deadline = outcome.dropped_deadline + sum(
            t > outcome.end_s for t in self._rejected_finish.values())
        record.dropped_link = outcome.dropped_link
        record.dropped_rejected = sum(t <= outcome.end_s for t in self._rejected_finish.values())

    def _wire_round(self, replies: list[Message], round_s: float) -> dict[str, float]:
        """Totals of one round: what the clients that worked moved and spent (from their
        ``netem`` records), and what every other online node's idle traffic cost meanwhile."""
        out = dict.fromkeys(WIRE_KEYS, 0.0)
        busy_s = 0.0
        last: dict[str, float] = {}
        for msg in replies:
            values = reply_metrics(msg)
            out["client_rounds"] += 1
            for key in WIRE_KEYS[1:]:
                out[key] += values.get(key, 0.0)
            busy_s += values.get("transfer_s", 0.0) + values.get("compute_s", 0.0)
            if values.get("ok") and values.get("finish_s", -1.0) > last.get("finish_s", -1.0):
                last = values
        # The round's time split as the deployment's is measured: the client whose reply came
        # last, and the server's own time counted as orchestration.
        proto = self.netem.protocol_model()
        out.update(critical_compute_s=last.get("compute_s", 0.0),
                   critical_transfer_s=last.get("transfer_s", 0.0),
                   critical_orchestration_s=last.get("orchestration_s", 0.0) + (
                       proto.server_s if proto is not None else 0.0))
        idle_node_s = max(0.0, self.netem.num_clients * round_s - busy_s)
        up, down, joules = idle_rates(self.netem)
        out.update(idle_up_bytes=up * idle_node_s, idle_down_bytes=down * idle_node_s,
                   idle_j=joules * idle_node_s, round_s=round_s)
        return out

    def wire_summary(self) -> dict[str, Any]:
        """Payload and link bytes per client-round both ways, joules per client-round, in all
        and to the target accuracy (``summary.json``'s ``wire`` entry)."""
        rounds = [self.wire_rounds[r.round] for r in self.rounds if r.round in self.wire_rounds]
        n = sum(w["client_rounds"] for w in rounds)
        total = {k: sum(w[k] for w in rounds) for k in (*WIRE_KEYS, *IDLE_KEYS)}
        per = {k: (total[k] / n if n else None) for k in WIRE_KEYS[1:]}
        joules = total["radio_j"] + total["compute_j"] + total["idle_j"]
        to_target: float | None = None
        if self.target_accuracy > 0:
            spent = 0.0
            for r in self.rounds:
                w = self.wire_rounds.get(r.round)
                if w is not None:
                    spent += w["radio_j"] + w["compute_j"] + w["idle_j"]
                if math.isfinite(r.accuracy) and r.accuracy >= self.target_accuracy:
                    to_target = spent
                    break
        later = [w for r, w in sorted(self.wire_rounds.items()) if r > 1] or rounds
        split = {k: (sum(w.get(f"critical_{k}_s", 0.0) for w in later) / len(later)
                     if later else None) for k in ("compute", "transfer", "orchestration")}
        return {"protocol": self.netem.protocol, "client_rounds": int(n),
                # Mean over rounds after the first (a deployment's first carries start-up).
                "round_split_s": split,
                **{f"{k}_per_client_round": v for k, v in per.items()},
                "joules_per_client_round": ((total["radio_j"] + total["compute_j"]) / n
                                            if n else None),
                "idle_joules": total["idle_j"], "idle_up_bytes": total["idle_up_bytes"],
                "idle_down_bytes": total["idle_down_bytes"], "joules_total": joules,
                "joules_to_target": to_target,
                # Per round (until the server's records take extra columns): joules of the
                # clients that worked and of the idle nodes, and link bytes both ways.
                "per_round": [{"round": r, "joules": w["radio_j"] + w["compute_j"] + w["idle_j"],
                               "link_up_bytes": w["link_up_bytes"] + w["idle_up_bytes"],
                               "link_down_bytes": w["link_down_bytes"] + w["idle_down_bytes"]}
                              for r, w in sorted(self.wire_rounds.items())]}

    def summary_extra(self) -> dict[str, Any]:
        """The emulator's keys of ``summary.json``."""
        total = sum(r.virtual_seconds for r in self.rounds)
        to_target: float | None = None
        if self.target_accuracy > 0:
            elapsed = 0.0
            for r in self.rounds:
                elapsed += r.virtual_seconds
                if math.isfinite(r.accuracy) and r.accuracy >= self.target_accuracy:
                    to_target = elapsed
                    break
        return {"virtual_seconds": total, "virtual_seconds_to_target": to_target,
                "target_accuracy": self.target_accuracy or None,
                "dropped_deadline": sum(r.dropped_deadline for r in self.rounds),
                "dropped_link": sum(r.dropped_link for r in self.rounds),
                "dropped_rejected": sum(r.dropped_rejected for r in self.rounds),
                "wire": self.wire_summary(),
                "netem": self.netem.to_config()}

    def state_dict(self) -> dict[str, Any]:
        """DGCStrategy's state plus the virtual clock and the rounds' wire totals."""
        return {**super().state_dict(), "virtual_now_s": self.virtual_now_s,
                "wire_rounds": {int(k): dict(v) for k, v in self.wire_rounds.items()}}

    def load_state_dict(self, state: Any) -> None:
        """Continue from :meth:`state_dict`, virtual clock included."""
        super().load_state_dict(state)
        self.virtual_now_s = float(state.get("virtual_now_s", 0.0))
        self.wire_rounds = {int(k): dict(v) for k, v in state.get("wire_rounds", {}).items()}


#: Per-round sums of the clients' ``netem`` records (``client_rounds`` counts them).
WIRE_KEYS = ("client_rounds", "payload_up_bytes", "payload_down_bytes", "link_up_bytes",
             "link_down_bytes", "transfer_s", "orchestration_s", "radio_j", "compute_j")
IDLE_KEYS = ("idle_up_bytes", "idle_down_bytes", "idle_j")


def idle_rates(netem: NetemSettings) -> tuple[float, float, float]:
    """An online idle node's bytes per second up and down, and its radio's watts (averaged over
    the scenario's link mix), from the protocol's polls and heartbeats."""
    proto = netem.protocol_model()
    if proto is None:
        return 0.0, 0.0, 0.0
    up, down = proto.idle_bytes(1.0)
    models = netem.power_models()
    watts = 0.0
    for link, fraction in parse_fractions(netem.mix, "mix").items():
        radio = LINK_RADIO.get(link)
        if radio is not None and radio in models:
            watts += fraction * idle_watts(models[radio], proto)
    return up, down, watts


def idle_watts(model: RadioPowerModel, proto: ProtocolModel, span_s: float = 3600.0) -> float:
    """Mean radio power of an idle node over an hour of its polls and heartbeats (each a
    transfer lasting one round trip's worth of bytes at no more than 1 Mbit/s)."""
    transfers = []
    for interval, up, down in ((proto.poll_interval_s, proto.poll_bytes_up,
                                proto.poll_bytes_down),
                               (proto.heartbeat_interval_s, proto.heartbeat_bytes_up,
                                proto.heartbeat_bytes_down)):
        if interval <= 0:
            continue
        duration = max(0.05, 8.0 * (up + down) / 1e6)
        t = interval
        while t < span_s:
            transfers.append(Transfer(t, t + duration, up_bytes=int(up), down_bytes=int(down)))
            t += interval
    if not transfers:
        return 0.0
    return radio_energy(model, transfers, until_s=span_s, warm=True).total_j / span_s
