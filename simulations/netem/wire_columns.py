"""The emulator's wire and energy columns: payload and link bytes both ways, each with its ratio
to dense FedAvg, joules, and the round's time split, through the server's extension point.

Every client the emulator runs reports, in its reply's ``netem`` record
(:mod:`simulations.netem.mod`), the payload it moved each way, the bytes its link carried for
them (``netem.protocol``'s requests, envelopes and acknowledgements included; the encoded Flower
message without a protocol), its transfer and orchestration seconds and the joules its radio and
processor spent. :class:`WireColumns` (a :class:`server.extensions.RoundExtension`) adds them up:

- ``rounds.csv``: the round's payload ratios to dense (``uplink_compression``,
  ``downlink_compression``: the core's ``dense_*_bytes`` over its ``*_bytes``), its link bytes
  (``wire_uplink_bytes``, ``wire_downlink_bytes``), what dense FedAvg would have put on the same
  links for the same client-rounds (``dense_wire_*``) and their ratios
  (``wire_*_compression``), the idle nodes' traffic, the joules of the clients that worked and
  of the idle nodes, and the round's compute / transfer / orchestration split (the client whose
  reply came last, the server's own time counted as orchestration), with the orchestration's
  named parts (``round_poll_s``, ``round_trips_s``, ``round_startup_s``, ``round_server_s``);
- ``clients.csv``: each client's link preset, its link bytes both ways and its joules (radio
  and compute; ``radio_joules`` the radio's part);
- ``summary.json``: the same totals with their ratios (``wire_total_compression``, ...), per
  client-round means, ``joules_per_client_round`` and ``joules_total`` (what a run spent to its
  target accuracy is :mod:`simulations.netem.target`'s, in the emulator's summary), and a
  ``wire`` entry with the protocol, its profile in words and the round split.

Dense FedAvg's link bytes for a client-round: with a protocol model, what it charges for the
dense model down and a dense float32 update up (one Array per tensor, as Flower ships a
state dict); without one, the client's own link bytes with its payload replaced by the dense
one. A client that received nothing (unavailable) counts no dense bytes either way; one that
sent nothing counts no dense upload.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from server.extensions import Added, Column, Reply, RoundExtension
from server.records import ClientRow, RoundRecord
from server.results import traffic
from simulations.netem.energy import LINK_RADIO, RadioPowerModel, Transfer, radio_energy
from simulations.netem.mod import reply_metrics
from simulations.netem.protocol import ORCHESTRATION_PARTS, ProtocolModel, message_objects
from simulations.netem.settings import (
    NetemSettings,
    assignment_for,
    parse_fractions,
    profile_line,
)

if TYPE_CHECKING:
    from simulations.netem.extension import NetemClock

__all__ = ["CLIENT_COLUMNS", "ROUND_COLUMNS", "WireColumns", "idle_rates", "idle_watts"]

#: Records of a dense FedAvg message each way (the arrays and the config, the arrays and the
#: metrics): the objects the protocol model charges besides the arrays.
_DENSE_RECORDS = 2

#: Per-round sums over the round's client-rounds (those with a ``netem`` record).
_SUMS = ("payload_up_bytes", "payload_down_bytes", "link_up_bytes", "link_down_bytes",
         "dense_link_up_bytes", "dense_link_down_bytes", "radio_j", "compute_j")


def _ratio(dense: float, sent: float) -> float:
    return dense / sent if sent else float("nan")


class WireColumns(RoundExtension):
    """Payload and link bytes with their ratios to dense, joules and the round split (module
    docstring), from the ``netem`` records of every reply of the round (arrived or not: the
    wire carried them), over the round's virtual time (the ``virtual_seconds`` column of
    ``clock``, which runs first) and with its server seconds (``clock.round_server_s``).

    Parameters
    ----------
    netem : NetemSettings
        The scenario: its protocol, link mix and clients.
    clock : NetemClock
        The emulator's round clock, whose server seconds this splits out.
    """

    columns = (
        Column("uplink_compression"), Column("downlink_compression"),
        Column("wire_uplink_bytes", "bytes/wire_uplink"),
        Column("wire_downlink_bytes", "bytes/wire_downlink"),
        Column("dense_wire_uplink_bytes"), Column("dense_wire_downlink_bytes"),
        Column("wire_uplink_compression", "compression/wire_uplink"),
        Column("wire_downlink_compression", "compression/wire_downlink"),
        Column("idle_uplink_bytes"), Column("idle_downlink_bytes"),
        Column("joules", "energy/joules", "{:7.1f} J"), Column("idle_joules", "energy/idle_joules"),
        Column("client_rounds"),
        Column("round_compute_s"), Column("round_transfer_s"), Column("round_orchestration_s"),
        # The orchestration's named parts (simulations.netem.protocol.ORCHESTRATION_PARTS).
        Column("round_poll_s"), Column("round_trips_s"), Column("round_startup_s"),
        Column("round_server_s"),
    )

    def __init__(self, netem: NetemSettings, clock: NetemClock) -> None:
        self.netem, self.clock = netem, clock
        self._tensor_bytes: list[int] = []  # float32 bytes of each model tensor
        self._taken: dict[int, dict[int, dict[str, float]]] = {}
        # Per link preset: [joules, client-rounds] of the clients that worked on it.
        self.by_link: dict[str, list[float]] = {}

    def set_model(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Keep the model's tensor sizes: what dense FedAvg ships."""
        self._tensor_bytes = [4 * math.prod(shape) for shape in shapes.values()]

    def arrived(self, server_round: int, replies: Sequence[Reply]) -> Sequence[Reply]:
        """Keep the ``netem`` records of the round's replies, by client key; every reply
        arrives as far as the wire is concerned."""
        per_client: dict[int, dict[str, float]] = {}
        for reply in replies:
            values = {k: v for k, v in reply_metrics(reply.message).items()
                      if math.isfinite(v) and v >= 0}
            if values:
                per_client[reply.client_key] = values
        self._taken[server_round] = per_client
        return replies

    # ---- RoundExtension ----------------------------------------------------------------------
    def after_round(self, record: RoundRecord, rows: list[ClientRow]) -> Added:
        """The round's wire, energy and time columns (module docstring)."""
        per_client = self._taken.pop(record.round, {})
        server_s = self.clock.round_server_s(record.round)
        round_s = float(record.extra.get("virtual_seconds", 0.0))  # the clock's, server's too
        proto = self.netem.protocol_model()
        sums = dict.fromkeys(_SUMS, 0.0)
        clients: dict[int, dict[str, int | float | str]] = {}
        busy_s = 0.0
        last: dict[str, float] = {}
        rows_of = {row.client_key for row in rows}
        for key, v in per_client.items():
            dense_up, dense_down = self._dense_link(v, proto)
            v = {**v, "dense_link_up_bytes": dense_up, "dense_link_down_bytes": dense_down}
            for k in _SUMS:
                sums[k] += v.get(k, 0.0)
            busy_s += v.get("transfer_s", 0.0) + v.get("compute_s", 0.0)
            if v.get("ok") and v.get("finish_s", -1.0) > last.get("finish_s", -1.0):
                last = v
            link = self._link_of(key)
            spent = self.by_link.setdefault(link, [0.0, 0])
            spent[0] += v.get("radio_j", 0.0) + v.get("compute_j", 0.0)
            spent[1] += 1
            if key in rows_of:
                clients[key] = {"link": link,
                                "wire_uplink_bytes": int(v.get("link_up_bytes", 0)),
                                "wire_downlink_bytes": int(v.get("link_down_bytes", 0)),
                                "joules": v.get("radio_j", 0.0) + v.get("compute_j", 0.0),
                                "radio_joules": v.get("radio_j", 0.0)}
        idle_node_s = max(0.0, self.netem.num_clients * round_s - busy_s)
        up_rate, down_rate, watts = idle_rates(self.netem)
        values: dict[str, int | float] = {
            "uplink_compression": _ratio(record.dense_uplink_bytes, record.uplink_bytes),
            "downlink_compression": _ratio(record.dense_downlink_bytes, record.downlink_bytes),
            "wire_uplink_bytes": round(sums["link_up_bytes"]),
            "wire_downlink_bytes": round(sums["link_down_bytes"]),
            "dense_wire_uplink_bytes": round(sums["dense_link_up_bytes"]),
            "dense_wire_downlink_bytes": round(sums["dense_link_down_bytes"]),
            "wire_uplink_compression": _ratio(sums["dense_link_up_bytes"],
                                              sums["link_up_bytes"]),
            "wire_downlink_compression": _ratio(sums["dense_link_down_bytes"],
                                                sums["link_down_bytes"]),
            "idle_uplink_bytes": round(up_rate * idle_node_s),
            "idle_downlink_bytes": round(down_rate * idle_node_s),
            "joules": sums["radio_j"] + sums["compute_j"],
            "idle_joules": watts * idle_node_s,
            "client_rounds": len(per_client),
            "round_compute_s": last.get("compute_s", 0.0),
            "round_transfer_s": last.get("transfer_s", 0.0),
            "round_orchestration_s": last.get("orchestration_s", 0.0) + server_s,
            "round_poll_s": last.get("poll_s", 0.0),
            "round_trips_s": last.get("round_trips_s", 0.0),
            "round_startup_s": last.get("startup_s", 0.0),
            "round_server_s": server_s,
            # Kept for the summary's per client-round payload (rounds.csv has the core's).
            "payload_up_bytes": round(sums["payload_up_bytes"]),
            "payload_down_bytes": round(sums["payload_down_bytes"]),
        }
        return Added(values, clients)

    def summary(self, rounds: Sequence[RoundRecord]) -> dict[str, Any]:
        """Totals with their ratios to dense, per client-round means, joules in all, and the
        ``wire`` entry (module docstring)."""
        def total(name: str) -> float:
            return sum(float(r.extra.get(name, 0.0)) for r in rounds)

        n = total("client_rounds")
        wire = {(f"dense_wire_{k[6:]}" if k.startswith("dense_") else f"wire_{k}"): v
                for k, v in traffic(
            round(total("wire_uplink_bytes")), round(total("wire_downlink_bytes")),
            round(total("dense_wire_uplink_bytes")),
            round(total("dense_wire_downlink_bytes"))).items()}
        joules = total("joules") + total("idle_joules")
        # A deployment's first round carries start-up: the split is the mean of the others.
        later = [r for r in rounds if r.round > 1] or list(rounds)
        split = {k: (sum(float(r.extra.get(column, 0.0)) for r in later) / len(later)
                     if later else None) for k, column in SPLIT_COLUMNS.items()}

        def per(name: str) -> float | None:
            return total(name) / n if n else None

        return {
            **wire,
            "idle_uplink_bytes": round(total("idle_uplink_bytes")),
            "idle_downlink_bytes": round(total("idle_downlink_bytes")),
            "joules_per_client_round": per("joules"),
            "joules_per_client_round_by_link": {
                link: (j / n_link if n_link else None)
                for link, (j, n_link) in sorted(self.by_link.items())},
            "joules_total": joules,
            "idle_joules": total("idle_joules"),
            "wire": {"protocol": self.netem.protocol,
                     "profile": profile_line(self.netem), "client_rounds": int(n),
                     "round_split_s": split,
                     **{f"{k}_per_client_round": per(c) for k, c in (
                         ("payload_up_bytes", "payload_up_bytes"),
                         ("payload_down_bytes", "payload_down_bytes"),
                         ("link_up_bytes", "wire_uplink_bytes"),
                         ("link_down_bytes", "wire_downlink_bytes"),
                         ("dense_link_up_bytes", "dense_wire_uplink_bytes"),
                         ("dense_link_down_bytes", "dense_wire_downlink_bytes"))}},
        }

    def state_dict(self) -> dict[str, Any]:
        """The per-link joules so far (the rest is in the rounds' columns)."""
        return {"by_link": {k: list(v) for k, v in self.by_link.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""
        self.by_link = {str(k): [float(v[0]), int(v[1])]
                        for k, v in state.get("by_link", {}).items()}

    def _link_of(self, key: int) -> str:
        """The link preset of client ``key`` in the scenario ("" when it has none)."""
        assignment = assignment_for(self.netem)
        return assignment.link_name(key) if 0 <= key < len(assignment) else ""

    # ---- dense FedAvg on the same links --------------------------------------------------------
    def _dense_link(self, v: Mapping[str, float], proto: ProtocolModel | None
                    ) -> tuple[float, float]:
        """(up, down) link bytes dense FedAvg would have moved in this client-round."""
        tensors = self._tensor_bytes
        model = update = sum(tensors)  # float32 arrays, as dense FedAvg ships its state dict
        got = v.get("payload_down_bytes", 0.0) > 0
        sent = v.get("payload_up_bytes", 0.0) > 0
        up = down = 0.0
        if proto is None:
            if got:
                down += v.get("link_down_bytes", 0.0) - v.get("payload_down_bytes", 0.0) + model
            if sent:
                up += v.get("link_up_bytes", 0.0) - v.get("payload_up_bytes", 0.0) + update
            return up, down
        objects = message_objects(tensors, _DENSE_RECORDS)
        if got:
            req, msg = proto.download(model, objects)
            up, down = up + req, down + msg
        if sent:
            msg, acks = proto.upload(update, objects)
            up, down = up + msg, down + acks
        return up, down


#: The round's time split (``summary.json``'s ``wire.round_split_s``): its parts and columns.
SPLIT_COLUMNS = {"compute": "round_compute_s", "transfer": "round_transfer_s",
                 "orchestration": "round_orchestration_s",
                 **{part: "round_trips_s" if part == "round_trips" else f"round_{part}_s"
                    for part in ORCHESTRATION_PARTS}}
#: What WireColumns adds to ``rounds.csv`` and ``clients.csv``, in order.
ROUND_COLUMNS = (*(c.name for c in WireColumns.columns), "payload_up_bytes", "payload_down_bytes")
CLIENT_COLUMNS = ("link", "wire_uplink_bytes", "wire_downlink_bytes", "joules", "radio_joules")


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
