"""Round records: what happened to each sampled client (``clients.csv``) and to each round
(``rounds.csv``), and the rejection counts of the run."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from logging import INFO, WARNING
from typing import Any

from flwr.supercore import log

from server.replies import CheckedReply


@dataclass
class ClientRow:
    """What happened to one sampled client in one round (one line of ``clients.csv``)."""

    round: int
    client_key: int
    node_id: int
    status: str  # aggregated | rejected | error | timeout | surplus (| an extension's, dropped)
    reason: str = ""
    downlink: str = ""
    downlink_bytes: int = 0
    uplink_bytes: int = 0
    nnz: int = 0
    density: float = 0.0
    compression_ratio: float = 0.0
    num_examples: int = 0
    train_loss: float = float("nan")
    compute_seconds: float = 0.0
    restored: int = 0
    ray_node: str = ""  # the Ray node that ran the round, as its reply names it (client.node)
    state_quarantined: int = 0  # damaged state records the client set aside (client.app)
    # Columns of extensions (server.extensions), by name: the core names none of them.
    extra: dict[str, int | float | str] = field(default_factory=dict)


@dataclass
class RoundRecord:
    """One round's totals (one line of ``rounds.csv``). Accuracy is a fraction in [0, 1]."""

    round: int
    accuracy: float = float("nan")
    loss: float = float("nan")
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    dense_uplink_bytes: int = 0
    dense_downlink_bytes: int = 0
    clients_sampled: int = 0
    clients_aggregated: int = 0
    clients_failed: int = 0
    clients_rejected: int = 0
    clients_surplus: int = 0  # valid replies not needed (over-selection): not failures
    patches_sent: int = 0
    nnz: int = 0
    train_loss: float = float("nan")
    compute_seconds_max: float = 0.0
    wall_seconds: float = 0.0
    model_version: int = 0
    state_quarantined: int = 0  # sum over the round's replies (damaged client state set aside)
    # Columns of extensions (server.extensions: the network emulator's virtual time and drops),
    # by name: the core names none of them.
    extra: dict[str, int | float] = field(default_factory=dict)


def client_row(server_round: int, reply: CheckedReply, downlink: tuple[str, int],
               dense_update_nbytes: int) -> ClientRow:
    """The row of a sampled client's checked reply (status "valid" until the strategy decides
    between aggregated and surplus); ``downlink``: (kind, bytes) of what it was sent."""
    row = ClientRow(server_round, reply.client_key, reply.node_id, reply.status, reply.reason,
                    downlink[0], downlink[1], reply.uplink_bytes, ray_node=reply.ray_node,
                    state_quarantined=reply.state_quarantined)
    if reply.payload is not None:
        row.nnz, row.density = reply.payload.nnz, reply.payload.density
    if reply.status == "valid":  # a masked vector (secure aggregation) has no payload here
        row.compression_ratio = dense_update_nbytes / reply.uplink_bytes
        row.num_examples, row.train_loss = reply.num_examples, reply.train_loss
        row.compute_seconds, row.restored = reply.compute_seconds, reply.restored
    return row


class RoundRows:
    """One round's client rows, filled as its checked replies are taken in.

    Parameters
    ----------
    server_round : int
        The round.
    sampled : list of int
        The sampled client keys, in sampling order (the order of the rows).
    node_of, downlink : mappings
        Per client key its node id, and (kind, bytes) of what it was sent.
    dense_update_nbytes : int
        What a dense float32 update costs: the baseline of the compression ratio.
    records : RunRecords
        Where refused replies are counted.
    """

    def __init__(self, server_round: int, sampled: list[int], node_of: dict[int, int],
                 downlink: dict[int, tuple[str, int]], dense_update_nbytes: int,
                 records: RunRecords) -> None:
        self.server_round, self.sampled = server_round, sampled
        self.node_of, self.downlink = node_of, downlink
        self.dense_update_nbytes, self.records = dense_update_nbytes, records
        self.rows: dict[int, ClientRow] = {}
        self.valid: dict[int, CheckedReply] = {}  # by client key, in arrival order
        self.uplink_bytes = 0

    def take(self, reply: CheckedReply) -> None:
        """Add a checked reply's row; a reply that is not one sampled client's first is only
        counted."""
        key, node = reply.client_key, reply.node_id
        if reply.status == "ignored" or key in self.rows:
            self.records.count_rejection("reply from a node that was not sampled or replied "
                                         "twice")
            log(WARNING, "\t> Ignored reply from node %d (client %d): not sampled in round %d "
                "or a duplicate", node, key, self.server_round)
            return
        self.rows[key] = client_row(self.server_round, reply, self.downlink[key],
                                    self.dense_update_nbytes)
        self.uplink_bytes += reply.uplink_bytes
        if reply.status == "valid":
            self.valid[key] = reply
        elif reply.status == "rejected":
            self.records.count_rejection(reply.reason.split(":")[0])
            log(WARNING, "\t> Rejected reply from node %d (client %d): %s", node, key,
                reply.reason)
        else:
            log(INFO, "\t> Received error in reply from node %d: %s", node, reply.reason)

    def close(self, clients_per_round: int) -> list[int]:
        """Rows for the sampled clients that did not reply (timed out), and the keys of the
        first ``clients_per_round`` valid replies in sampling order (deterministic, unlike
        arrival order), marked aggregated; the other valid ones are surplus."""
        for key in self.sampled:
            if key not in self.rows:
                kind, down = self.downlink[key]
                self.rows[key] = ClientRow(self.server_round, key, self.node_of[key], "timeout",
                                           "no reply before the round timeout", kind, down)
        chosen = [k for k in self.sampled if k in self.valid][:clients_per_round]
        for k in self.valid:
            self.rows[k].status = "aggregated" if k in chosen else "surplus"
        return chosen

    def ordered(self) -> list[ClientRow]:
        """The rows in sampling order."""
        return [self.rows[k] for k in self.sampled]


def round_record(server_round: int, rows: list[ClientRow], uplink_bytes: int,
                 dense_update_nbytes: int, dense_model_nbytes: int,
                 model_version: int) -> RoundRecord:
    """The totals of one round's ``rows`` (accuracy and loss are filled after evaluation).

    ``dense_update_nbytes`` and ``dense_model_nbytes`` are what a dense float32 update and the
    dense model cost: the baselines of the compression ratios.
    """
    aggregated = [r for r in rows if r.status == "aggregated"]
    arrived = [r for r in rows if r.status in ("aggregated", "surplus", "rejected")]
    weight = sum(r.num_examples for r in aggregated)
    return RoundRecord(
        round=server_round,
        uplink_bytes=uplink_bytes,
        downlink_bytes=sum(r.downlink_bytes for r in rows),
        dense_uplink_bytes=dense_update_nbytes * len(arrived),
        dense_downlink_bytes=dense_model_nbytes * len(rows),
        clients_sampled=len(rows),
        clients_aggregated=len(aggregated),
        clients_failed=sum(r.status in ("error", "timeout", "rejected") for r in rows),
        clients_rejected=sum(r.status == "rejected" for r in rows),
        clients_surplus=sum(r.status == "surplus" for r in rows),
        patches_sent=sum(r.downlink == "patch" for r in rows),
        nnz=sum(r.nnz for r in aggregated),
        train_loss=(sum(r.train_loss * r.num_examples for r in aggregated) / weight
                    if weight else float("nan")),
        compute_seconds_max=max((r.compute_seconds for r in arrived), default=0.0),
        model_version=model_version,
        state_quarantined=sum(r.state_quarantined for r in rows),
    )


class RunRecords:
    """The records of a run so far: finished rounds, client rows and rejection counts."""

    def __init__(self) -> None:
        self.rounds: list[RoundRecord] = []
        self.client_rows: list[ClientRow] = []
        # reason (up to its first colon) -> how many replies were refused for it
        self.rejections: dict[str, int] = {}

    def count_rejection(self, reason: str) -> None:
        """Count one refused reply under ``reason``."""
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def state_dict(self) -> dict[str, Any]:
        """The records as plain data (the checkpoint's ``rounds``, ``client_rows``, ...)."""
        return {"rounds": [asdict(r) for r in self.rounds],
                "client_rows": [asdict(r) for r in self.client_rows],
                "rejections": dict(self.rejections)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""
        self.rounds = [RoundRecord(**r) for r in state["rounds"]]
        self.client_rows = [ClientRow(**r) for r in state["client_rows"]]
        self.rejections = dict(state["rejections"])


def train_metrics(record: RoundRecord) -> dict[str, int | float]:
    """The round's MetricRecord entries (what Flower's ``Result`` keeps per round), the
    extensions' columns included."""
    return {"uplink_bytes": record.uplink_bytes, "downlink_bytes": record.downlink_bytes,
            "clients_aggregated": record.clients_aggregated,
            "clients_failed": record.clients_failed, "nnz": record.nnz,
            "train_loss": record.train_loss if math.isfinite(record.train_loss) else 0.0,
            **record.extra}
